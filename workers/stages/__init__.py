"""The pipeline stages. Each module has `main(ctx: RankContext)`, named in state/specs.py;
a stage imports its heavy libraries (torch, transformers, vLLM) itself."""
