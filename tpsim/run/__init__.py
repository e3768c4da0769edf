"""A run: its spec, the jobs each rank runs, launching them, the preflight checks and the report."""
