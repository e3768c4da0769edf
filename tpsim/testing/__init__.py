"""Jobs and helpers for the test suite (importable by spawned ranks, unlike test modules)."""
