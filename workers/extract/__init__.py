"""The extract stage's machinery: which rows each rank computes, the files it writes, and the transformers backend.

plan.py (settings, batches, the prepared dataset), output.py (binding an output folder to one
extraction, data_config.json, summary.json), hf.py (the `hf` backend), hswriter.py (the
background writer of hs_<idx>.safetensors). The `vllm` backend is eyas.workers.vllm.backend;
the stage's entry point is eyas.workers.stages.extract. Nothing is imported here.
"""
