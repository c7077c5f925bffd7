"""`eyas doctor CONFIG [--json] [--canary]`: the CLI side, which only hands over to the worker side.

The checks import torch, transformers and vLLM, which the daemon's side of eyas never does;
so this process replaces itself (os.execv) with `python -m eyas.workers.doctor`: one process,
no pipe in between, the report and the exit status exactly the worker's.
"""

from __future__ import annotations

import os
import sys

WORKER = "eyas.workers.doctor"


def command(args) -> int:
    flags = [flag for flag, on in (("--json", args.json), ("--canary", args.canary)) if on]
    argv = [sys.executable, "-m", WORKER, args.config, *flags]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 1  # not reached: execv returns only by raising
