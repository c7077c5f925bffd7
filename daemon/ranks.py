"""What the daemon knows of one rank process (Rank, RankExit) and how it reads what a rank left: its JSON records and its log's tail."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

# How much of a log's tail is read to find a native crash's stack.
_TAIL_BYTES = 64 * 1024


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def tail_text(path: Path, size: int = _TAIL_BYTES) -> str:
    """The last `size` bytes of a file as text; "" when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - size))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def log_tail(path: Path, max_lines: int = 40) -> str:
    """The end of a rank log; from the last native-crash header when there is one."""
    text = tail_text(path)
    crash = text.rfind("Fatal Python error:")
    if crash >= 0:
        return "\n".join(text[crash:].splitlines()[:200])
    return "\n".join(text.splitlines()[-max_lines:])


@dataclass
class RankExit:
    """How one rank ended, from its exit record, its error file and the monitor's status."""

    rank: int
    pid: int | None
    exit_code: int | None
    signal: int | None
    time: float
    error: dict | None = None
    oom_killed: bool = False
    lost: bool = False
    unexpected: bool = False  # a TP worker whose death vLLM called unexpected
    tp_rank: int | None = None  # set for a TP worker

    @property
    def failed(self) -> bool:
        return (
            self.lost
            or self.unexpected
            or self.signal is not None
            or (self.exit_code or 0) != 0
            or self.error is not None
        )

    @property
    def signal_name(self) -> str | None:
        if self.signal is None:
            return None
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"


@dataclass
class Rank:
    rank: int
    log_path: Path
    monitor_pid: int
    monitor_create_time: float | None
    popen: subprocess.Popen | None = None  # None when adopted by a restarted daemon
    pid: int | None = None  # the worker, from rank-<r>.proc.json
    create_time: float | None = None
    device: str | None = None
    host: str | None = None  # where it runs, when not the daemon's host (a Slurm rank's node)
    exit: RankExit | None = None
    role: str | None = None  # "driver", "tp-worker"; None for a plain rank
    tp_rank: int | None = None
    started_at: float | None = None
    ended_at: float | None = None  # a TP worker's end, as its pidfd said it
    last_write: float | None = None  # the newest mtime of its log and progress file seen so far
