"""Shared fixtures: running the real `eyas` command as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# The console script installed next to the interpreter that runs the tests (.venv/bin/eyas).
EYAS = str(Path(sys.executable).with_name("eyas"))


@pytest.fixture
def eyas_cli():
    """Run `eyas --home HOME ARGS...` in TZ=UTC; returns the CompletedProcess with str output,
    decoded without newline translation (so a "\\r" in a log line stays one)."""

    def run(home: Path, *args, timeout: float = 60) -> subprocess.CompletedProcess:
        env = {**os.environ, "TZ": "UTC"}
        env.pop("EYAS_HOME", None)
        p = subprocess.run([EYAS, "--home", str(home), *map(str, args)], capture_output=True, env=env,
                           timeout=timeout)
        return subprocess.CompletedProcess(p.args, p.returncode, p.stdout.decode(), p.stderr.decode())

    return run
