"""eyas.workers: the code that runs inside rank processes, grouped by concern; it meets the daemon only through the rank contract.

stages/ holds one thin entry point per pipeline stage (`main(ctx)`, named in state/specs.py);
what they use lives beside it: runtime/ (the rank monitor and runtime, progress, atomic
writes, torch.distributed), data/ (reading and rendering the user's data), models/ (the target:
adapters, loading, capture, test assets), extract/, train/, evaluate/ (each stage's machinery),
vllm/ (everything that touches vLLM, its version check included), doctor/ (`eyas doctor`).
nvml.py is the one module the daemon may import too. Imports no daemon or tui code
(state/contract.py, docs/ARCHITECTURE.md)."""
