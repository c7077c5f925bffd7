"""Stacks of a live stage's processes, for a stage that hangs instead of failing: each one's
Python stacks (faulthandler, into its own log) and native stacks (py-spy, daemon/native.py).

A rank stuck in a collective or a rendezvous neither exits nor raises, so the daemon has
nothing to capture. Every rank runtime registers faulthandler on SIGUSR1 (workers/runtime/rank.py):
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

import psutil

from eyas.wire.stacks import dump_of

from . import native, phases

# Seconds for signalled ranks to write their Python stacks: faulthandler writes from its C
# signal handler at once, so this only covers a machine too loaded to schedule them.
PYTHON_WAIT = 1.5


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

    `ranks` are daemon.ranks.Rank objects. A record has "skipped" (why the process has no stacks
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


def with_descendants(entries: list[dict], watch, now: float, descendants: bool = True) -> list[dict]:
    """`entries` (request()'s) with each process's state from the watch (daemon/phases.py), and,
    with `descendants`, one entry more for every live process under a rank that is none of
    eyas's own (vLLM's EngineCore, a compile worker): py-spy dumps it, faulthandler cannot."""
    known = {e.get("pid") for e in entries}
    if descendants:
        for p in sorted(watch.procs.values(), key=lambda p: (p.rank, p.pid)):
            if p.role == "monitor" or p.pid in known:
                continue
            owner = next((e for e in entries if e.get("rank") == p.rank), {})
            entries.append(
                {
                    "rank": p.rank,
                    "role": "descendant",
                    "label": p.label,
                    "tp_rank": None,
                    "pid": p.pid,
                    "log_path": owner.get("log_path"),
                    "python_skipped": "not an eyas rank (it registers no stack dump): see its native stacks",
                }
            )
    for e in entries:
        if "skipped" in e or not e.get("pid"):
            continue
        p = watch.procs.get(e["pid"])
        if p is not None:
            e.update(phases.describe(p, now))
        else:  # not sampled yet (it started within the last second): its state now, without a duration
            try:
                proc = psutil.Process(e["pid"])
                with proc.oneshot():
                    times = proc.cpu_times()
                    e.update(state=proc.status(), cpu=round(times.user + times.system, 3))
            except psutil.Error:
                pass
    return entries


async def collect(
    ranks,
    python_wait: float = PYTHON_WAIT,
    native_timeout: float = native.TIMEOUT,
    requester=request,
    native_stacks: bool = True,
) -> list[dict]:
    """Every live process's stacks: `requester`'s records (request(), or a Slurm group's, which
    signals through Slurm) with the signalled ranks' Python dump under "python" and, with
    `native_stacks`, py-spy's native dump added (native.add_to).

    py-spy runs only once the Python dumps are in, or `python_wait` has passed: a signal that
    arrives while py-spy holds a process under ptrace can be swallowed by its detach."""
    entries = requester(ranks)
    asked = [e for e in entries if "offset" in e]
    deadline = asyncio.get_running_loop().time() + python_wait
    while True:
        for e in asked:
            e["python"] = e.get("python") or dump_of(e)
        if all(e["python"] for e in asked) or asyncio.get_running_loop().time() >= deadline:
            break
        await asyncio.sleep(0.05)
    return await native.add_to(entries, native_timeout) if native_stacks else entries
