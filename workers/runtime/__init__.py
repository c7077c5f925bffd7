"""The rank runtime: what every rank process runs around its stage, and the small stdlib helpers it shares.

monitor.py (`python -m eyas.workers.runtime.monitor`, the daemon's child) runs rank.py
(`python -m eyas.workers.runtime.rank`), which calls the stage's entry point; progress.py and
atomic.py write the rank's files the daemon reads; dist.py is the one torch.distributed wrapper;
cpu_share.py sizes a CPU rank's threads. Nothing is imported here: the monitor must start fast.
"""
