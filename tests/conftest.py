"""Shared fixtures: running the real `eyas` command as a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# The console script installed next to the interpreter that runs the tests (.venv/bin/eyas).
EYAS = str(Path(sys.executable).with_name("eyas"))

# Hermetic: every model the tests use is built on disk, so nothing may reach for a network that
# CI machines do not have (where a lookup can wait instead of failing at once). Set before any
# daemon starts, so its ranks and their vLLM engines inherit it. vLLM's usage report also
# starts a py-cpuinfo subprocess per engine.
for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
    os.environ.setdefault(_name, "1")

# Ctrl-C as a terminal delivers it: a suite started in the background by a non-interactive
# shell (`make test &`) inherits SIGINT ignored, every child it starts would too, and the
# tests that press Ctrl-C on `eyas demo` or `eyas logs -f` would wait for nothing. A handler
# here (not SIG_IGN) is reset to the default in every child at exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def eyas_cli():
    """Run `eyas --home HOME ARGS...` in TZ=UTC; returns the CompletedProcess with str output,
    decoded without newline translation (so a "\\r" in a log line stays one)."""

    def run(home: Path, *args, timeout: float = 60) -> subprocess.CompletedProcess:
        env = {**os.environ, "TZ": "UTC"}
        env.pop("EYAS_HOME", None)
        p = subprocess.run([EYAS, "--home", str(home), *map(str, args)], capture_output=True, env=env, timeout=timeout)
        return subprocess.CompletedProcess(p.args, p.returncode, p.stdout.decode(), p.stderr.decode())

    return run
