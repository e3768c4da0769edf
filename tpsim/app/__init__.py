"""The launcher side, argparse-free: ranks, preflight, the report, triage, scenarios."""
