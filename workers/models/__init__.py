"""The target model: where each family keeps its decoder, loading it with transformers, and capturing its residual stream.

adapters.py (the families, stdlib only), classwalk.py (a class's submodules read from source),
hf_target.py (loading with transformers), capture.py (the transformers-side hooks), assets.py
(the tiny deterministic targets, tokenizer and chats of the tests and `eyas demo`). Nothing is
imported here: torch and transformers load only inside the functions that need them.
"""
