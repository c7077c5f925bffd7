"""Training the EAGLE-3 draft: its data, model, loop, metrics and checkpoints.

data.py (extract's hidden states and prepare's masks, packed by tokens), model.py (the draft, as
speculators builds it), loop.py (the training loop on torch.distributed), metrics.py (the figures
and throughput), checkpoint.py (speculators' format, saved atomically). The stage's entry point is
eyas.workers.stages.train. Nothing is imported here.
"""
