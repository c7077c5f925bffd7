"""The stacks reply (`eyas stacks`, and the watchdog's report): how one process's entry reads as text, its Python dump re-read from its log.

An entry is a dict made by the daemon (daemon/stacks.py): rank, pid, role ("descendant" for a
process under a rank that is none of eyas's, with its "label"), log_path, and "offset" (where the
log stood when the process was signalled) with "python", or the "skipped"/"python_skipped"
reason; "native" or "native_skipped" from py-spy; and from /proc its "state" (psutil's name),
"state_for" (seconds in it, as the daemon saw), "cpu" seconds and, for a stuck one, "wchan".
"""

from __future__ import annotations

import re
from pathlib import Path

from eyas.state.logcut import Tail

# faulthandler's own headers, "Current thread 0x... (most recent call first):" and
# "Thread 0x... (...):", each followed by its "  File ..." frames.
_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):")
_FRAME = re.compile(r"^  (File |<no Python frame>|\.\.\.)")


def render(entry: dict, python: str | None = None) -> str:
    """One process's stacks as text: its Python dump (faulthandler) then its native one
    (py-spy), each or the line saying why it is missing. `python` overrides entry["python"]."""
    if "skipped" in entry:
        return f"no stacks: {entry['skipped']}"
    python = entry.get("python", "") if python is None else python
    parts = [state_line(entry)] if "state" in entry else []
    if "offset" in entry:
        stopped = entry.get("state") in ("stopped", "tracing-stop")
        parts.append(
            python
            or (
                "(no Python stacks: it is stopped, and writes its dump only once continued)"
                if stopped
                else "(it wrote no Python stacks in time)"
            )
        )
    else:
        parts.append(f"no Python stacks: {entry.get('python_skipped', 'not asked')}")
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


# How /proc's states read (psutil's names); the two that hold up a group first.
STATES = {
    "stopped": "stopped (SIGSTOP or a debugger holds it)",
    "tracing-stop": "stopped by a tracer",
    "disk-sleep": "in uninterruptible disk wait (D)",
    "running": "running",
    "sleeping": "sleeping",
    "zombie": "a zombie (exited, not reaped)",
}


def state_line(entry: dict) -> str:
    """ "state: stopped (...) for 42 s, cpu 3.1 s; waiting in do_signal_stop"."""
    line = f"state: {STATES.get(entry['state'], entry['state'])}"
    if entry.get("state_for") is not None:
        line += f" for {entry['state_for']:.0f} s"
    if entry.get("cpu") is not None:
        line += f", cpu {entry['cpu']:.1f} s"
    if entry.get("wchan"):
        line += f"; waiting in the kernel's {entry['wchan']}"
    return line


def who(entry: dict) -> str:
    """How a request() record names its process: "rank 1", "TP worker 3", or a descendant's
    label ("VLLM::EngineCore under rank 0")."""
    if entry.get("role") == "descendant":
        return entry.get("label") or f"a process under rank {entry['rank']}"
    return f"TP worker {entry['tp_rank']}" if entry.get("role") == "tp-worker" else f"rank {entry['rank']}"


def dump_of(entry: dict) -> str:
    """The stacks a signalled rank has written so far ("" before it has, or if it was skipped)."""
    return stacks_from(read_from(Path(entry["log_path"]), entry["offset"])) if "offset" in entry else ""
