"""eyas.daemon: the supervising daemon process: socket API, scheduler, agent, recovery and the rank groups.

Never imports torch, transformers, vllm or textual (the daemon must start fast), nor the CLI
or the TUI: those reach it through eyas.wire.
"""
