"""eyas.workers: code that runs inside rank processes (stages, model adapters, backends,
the rank runtime). Imports no daemon or tui code; it meets the daemon only through the
rank contract (state/contract.py, docs/ARCHITECTURE.md)."""
