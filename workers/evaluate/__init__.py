"""Measuring the trained draft in vLLM: the drafts, the prompts, the engines and the figures.

drafts.py (the trained draft and its untrained baseline), prompts.py (the held-out prompts),
engines.py (one vLLM engine per measurement, each in a child process), report.py (acceptance,
throughput and losslessness from the counters). The stage's entry point is
eyas.workers.stages.evaluate. Nothing is imported here.
"""
