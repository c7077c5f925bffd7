"""The canary: a shrunken, dummy-weight copy of a run's real extraction path, run before the real one (canary/run.py)."""
