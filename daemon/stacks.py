"""Stacks of a live stage's processes, for a stage that hangs instead of failing: each one's
Python stacks (faulthandler, into its own log) and native stacks (py-spy, daemon/native.py).

A rank stuck in a collective or a rendezvous neither exits nor raises, so the supervisor has
nothing to capture. Every rank runtime registers faulthandler on SIGUSR1 (workers/runtime.py):
the signal makes it write all its threads' stacks into its own log and go on. Signalling a
process that has not registered yet would kill it (SIGUSR1's default action), so each pid is
checked first in /proc/<pid>/status (SigCgt, the caught-signal mask). faulthandler needs no
ptrace rights, which containers often withhold; py-spy adds the C frames where it may attach.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

from eyas.state.logcut import Tail

from . import native

# Seconds for signalled ranks to write their Python stacks: faulthandler writes from its C
# signal handler at once, so this only covers a machine too loaded to schedule them.
PYTHON_WAIT = 1.5

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
    """Signal each live rank that can dump its Python stacks; one record per rank.

    `ranks` are supervisor.Rank objects. A record has "skipped" (why the process has no stacks
    at all: it is not running), or "offset" (the log's size before the signal, so a reader
    finds the dump after it: stacks_from), or "python_skipped" (why it was not signalled;
    py-spy still dumps it)."""
    out = []
    for r in ranks:
        entry = {"rank": r.rank, "role": r.role, "tp_rank": r.tp_rank, "pid": r.pid, "log_path": str(r.log_path)}
        if r.exit is not None or r.pid is None:
            entry["skipped"] = "not running" if r.exit is not None else "not started yet"
        elif r.role == "tp-worker":
            # vLLM's worker processes write into the driver's log through a prefix; an unprefixed
            # dump there would read as the driver's. py-spy's dump covers its Python frames too.
            entry["python_skipped"] = "a vLLM TP worker writes into its driver's log: see its native stacks"
        elif not catches(r.pid):
            entry["python_skipped"] = "has not registered its stack dump yet (still starting)"
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


async def collect(ranks, python_wait: float = PYTHON_WAIT, native_timeout: float = native.TIMEOUT) -> list[dict]:
    """Every live process's stacks: request()'s records with the signalled ranks' Python dump
    under "python" and py-spy's native dump added (native.add_to).

    py-spy runs only once the Python dumps are in, or `python_wait` has passed: a signal that
    arrives while py-spy holds a process under ptrace can be swallowed by its detach."""
    entries = request(ranks)
    asked = [e for e in entries if "offset" in e]
    deadline = asyncio.get_running_loop().time() + python_wait
    while True:
        for e in asked:
            e["python"] = e.get("python") or dump_of(e)
        if all(e["python"] for e in asked) or asyncio.get_running_loop().time() >= deadline:
            break
        await asyncio.sleep(0.05)
    return await native.add_to(entries, native_timeout)


def render(entry: dict, python: str | None = None) -> str:
    """One process's stacks as text: its Python dump (faulthandler) then its native one
    (py-spy), each or the line saying why it is missing. `python` overrides entry["python"]."""
    if "skipped" in entry:
        return f"no stacks: {entry['skipped']}"
    python = entry.get("python", "") if python is None else python
    if "offset" in entry:
        parts = [python or "(it wrote no Python stacks in time)"]
    else:
        parts = [f"no Python stacks: {entry.get('python_skipped', 'not asked')}"]
    if "native" in entry:
        parts.append(f"native stacks (py-spy dump --native):\n{entry['native']}")
    elif "native_skipped" in entry:
        parts.append(f"no native stacks: {entry['native_skipped']}")
    return "\n\n".join(parts)


def report(entries: list[dict], first: dict | None = None) -> str:
    """The stacks of every process of `entries` that was running, `first`'s block first:
    "rank 1 (pid 42):" then render()'s text, the Python dump re-read from the log now that
    the process has had time to finish writing it."""
    shown = [e for e in entries if e.get("skipped") != "not running"]
    if first is not None and first in shown:
        shown.remove(first)
        shown.insert(0, first)
    return "\n\n".join(f"{who(e)} (pid {e['pid']}):\n{render(e, dump_of(e) or e.get('python'))}" for e in shown)


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
    """A log's text from `offset` (where the signal found it) to its end; "" if unreadable.
    A log cut at its bound meanwhile is read from its marker line (state/logcut.py)."""
    tail = Tail(path, offset)
    try:
        return b"".join(iter(lambda: tail.read(final=True), b"")).decode(errors="replace")
    finally:
        tail.close()


def who(entry: dict) -> str:
    """How a request() record names its process: "rank 1", or "TP worker 3"."""
    return f"TP worker {entry['tp_rank']}" if entry.get("role") == "tp-worker" else f"rank {entry['rank']}"


def dump_of(entry: dict) -> str:
    """The stacks a signalled rank has written so far ("" before it has, or if it was skipped)."""
    return stacks_from(read_from(Path(entry["log_path"]), entry["offset"])) if "offset" in entry else ""
