"""Everything eyas does inside and around vLLM: the version check, engine settings, the extract driver and its worker extension.

version.py (which vLLM is installed, and whether eyas supports it), settings.py (platform-dependent
engine settings), backend.py (the extract stage's `vllm` backend, in the driver rank), engine.py
(the engine it drives), dataparallel.py (several ranks' engines over one plan), ext.py (the
worker extension vLLM imports into every tensor-parallel worker), capture.py and layout.py (the
capture inside a worker). Nothing is imported here, vLLM least of all; `import vllm` in these
modules is the real vLLM (absolute imports).
"""
