"""eyas.daemon: the supervisor process, its socket API, the `eyas` CLI and the client library.

Never imports torch, transformers, vllm or textual: the daemon must start fast.
"""
