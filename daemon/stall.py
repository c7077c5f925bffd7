"""The stall rule: a stage whose ranks all go quiet for its stall_timeout is stuck, and this
module says when and writes the root-cause error.

A rank stuck in a collective, a rendezvous or a deadlocked engine neither exits nor raises; left
alone it holds the GPUs until a two-hour collective timeout, or for ever. The daemon watches the
attempt directory (every rank's log and progress file live there): when nothing in it has
changed for `[stages.<name>] stall_timeout` seconds (the stage spec's default when unset; 0
turns the rule off), the watchdog (daemon/watchdog.py) collects every live process's stacks and
tears the group down as failed. The root-cause error is "Stalled", its traceback the stacks, and
max_restarts applies as to any failure. Long silent phases (weight load, engine start-up,
checkpoint save) append heartbeat lines to the progress files, which keeps the directory
changing; the last heartbeat's phase is named in the message.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eyas.state import contract
from eyas.wire.stacks import report

from .ranks import tail_text


def activity(directory: Path) -> tuple:
    """What the ranks have written so far: (name, size, mtime) of every file in the attempt
    directory. It changes whenever a rank logs a line or reports progress."""
    try:
        with os.scandir(directory) as it:
            return tuple(sorted((e.name, s.st_size, s.st_mtime_ns) for e in it if e.is_file() for s in (e.stat(),)))
    except OSError:
        return ()


def check(group, now: float) -> dict | None:
    """The group's stall, once its directory has been unchanged for its stall_timeout:
    {"kind": "stall", "time", "quiet", "heartbeat"}; None while it is not stalled."""
    seen = activity(group.dir)
    if seen != group.activity:
        group.activity, group.active_at = seen, now
        return None
    if now - group.active_at < group.stall_timeout:
        return None
    return {"kind": "stall", "time": now, "quiet": now - group.active_at, "heartbeat": last_heartbeat(group.dir)}


def last_heartbeat(directory: Path) -> dict | None:
    """The newest heartbeat line of any progress file: {"phase", "time", "file"}, or None."""
    best = None
    for path in directory.glob(contract.PROGRESS_GLOB):
        for line in reversed(tail_text(path).splitlines()):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("heartbeat"):
                if best is None or float(rec.get("time") or 0) > best["time"]:
                    best = {
                        "phase": str(rec["heartbeat"]),
                        "time": float(rec.get("time") or 0),
                        "file": path.name.split(".")[0],
                    }
                break
    return best


def error_record(group, host: str) -> contract.ErrorRecord:
    """The root-cause error of a stalled attempt (a daemon.group.Group whose `stuck` is a stall)."""
    stuck = group.stuck
    asked = stuck.get("asked", [])
    live = [a for a in asked if a.get("skipped") != "not running"]
    first = next((a for a in live if "offset" in a), live[0] if live else asked[0] if asked else {})
    beat = stuck.get("heartbeat")
    said = (
        (
            f"; the last heartbeat was {beat['file'].replace('-', ' ')}'s {beat['phase']!r}, "
            f"{stuck['time'] - beat['time']:.0f} s before"
        )
        if beat
        else ""
    )
    return contract.ErrorRecord(
        rank=first.get("rank"),
        pid=first.get("pid"),
        host=host,
        type="Stalled",
        message=(
            f"no rank wrote a log line or progress for {stuck['quiet']:.0f} s "
            f"(stages.{group.stage}.stall_timeout = {group.stall_timeout:g}){said}; "
            "the live ranks' stacks follow"
        ),
        traceback=report(asked, first or None),
        time=stuck["time"],
        source="stall",
        path=first.get("log_path"),
    )
