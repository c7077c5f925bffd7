"""Python stacks of a live stage's ranks, for a stage that hangs instead of failing.

A rank stuck in a collective or a rendezvous neither exits nor raises, so the supervisor has
nothing to capture. Every rank runtime registers faulthandler on SIGUSR1 (workers/runtime.py):
the signal makes it write all its threads' stacks into its own log and go on. Signalling a
process that has not registered yet would kill it (SIGUSR1's default action), so each pid is
checked first in /proc/<pid>/status (SigCgt, the caught-signal mask). This stands in for
py-spy, which needs ptrace rights that containers often withhold.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

# faulthandler's own headers, "Current thread 0x... (most recent call first):" and
# "Thread 0x... (...):", each followed by its "  File ..." frames.
_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):")
_FRAME = re.compile(r"^  (File |<no Python frame>|\.\.\.)")


def catches(pid: int, signum: int = signal.SIGUSR1) -> bool:
    """Whether `pid` has a handler for `signum` (a sure sign its runtime registered one)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    found = re.search(r"^SigCgt:\s*([0-9a-f]+)$", text, re.M)
    return bool(found) and bool(int(found.group(1), 16) >> (signum - 1) & 1)


def request(ranks) -> list[dict]:
    """Signal each live rank that can dump its stacks; one record per rank, said or skipped.

    `ranks` are supervisor.Rank objects. The record carries the log's size before the signal,
    so a reader finds the dump after that offset (stacks_from)."""
    out = []
    for r in ranks:
        entry = {"rank": r.rank, "role": r.role, "tp_rank": r.tp_rank, "pid": r.pid, "log_path": str(r.log_path)}
        if r.exit is not None or r.pid is None:
            entry["skipped"] = "not running" if r.exit is not None else "not started yet"
        elif r.role == "tp-worker":
            # vLLM's worker processes write into the driver's log through a prefix; an unprefixed
            # dump there would read as the driver's. py-spy attaches from outside instead.
            entry["skipped"] = f"a vLLM TP worker: use py-spy dump --pid {r.pid}"
        elif not catches(r.pid):
            entry["skipped"] = "has not registered its stack dump yet (still starting)"
        else:
            try:
                entry["offset"] = os.path.getsize(r.log_path)
            except OSError:
                entry["offset"] = 0
            try:
                os.kill(r.pid, signal.SIGUSR1)
            except ProcessLookupError:
                entry["skipped"] = "exited just now"
                entry.pop("offset")
        out.append(entry)
    return out


def stacks_from(text: str) -> str:
    """The faulthandler dump in `text` (a log read from the signal's offset), without the other
    lines the rank printed meanwhile."""
    kept, inside = [], False
    for line in text.splitlines():
        if _HEADER.match(line):
            if kept:
                kept.append("")
            kept.append(line)
            inside = True
        elif inside and _FRAME.match(line):
            kept.append(line)
        else:
            inside = False
    return "\n".join(kept)


def read_from(path: Path, offset: int) -> str:
    """A log's text from `offset` (where the signal found it) to its end; "" if unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def who(entry: dict) -> str:
    """How a request() record names its process: "rank 1", or "TP worker 3"."""
    return f"TP worker {entry['tp_rank']}" if entry.get("role") == "tp-worker" else f"rank {entry['rank']}"


def dump_of(entry: dict) -> str:
    """The stacks a signalled rank has written so far ("" before it has, or if it was skipped)."""
    return stacks_from(read_from(Path(entry["log_path"]), entry["offset"])) if "offset" in entry else ""
