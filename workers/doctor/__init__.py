"""`eyas doctor`: check a run's config, target and machine before it starts, without loading a weight.

main.py (`python -m eyas.workers.doctor`, and run_checks for the preflight stage) runs the
checks, cheapest first: versions.py, data.py, target.py, devices.py, memory.py (on
memoryestimate.py's arithmetic), disk.py, tokenizer.py, adapter.py (first on vllmsource.py's
stand-ins for vLLM's classes); check.py is one check and the report they make. Nothing is imported here.
"""
