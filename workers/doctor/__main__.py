"""`python -m eyas.workers.doctor CONFIG [--json]`: what `eyas doctor` execs (doctor/main.py)."""

import os
import sys

from eyas.workers.doctor.main import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
# Skip the interpreter's teardown: with torch and vLLM imported it takes seconds (their
# atexit hooks and module finalizers) and the report is already out.
os._exit(code)
