"""The stall watchdog: a stage whose ranks all go quiet is failed, with their stacks as the cause.

A rank stuck in a collective, a rendezvous or a deadlocked engine neither exits nor raises; left
alone it holds the GPUs until a two-hour collective timeout, or for ever. With
`[stages.<name>] stall_timeout = N` the daemon watches the attempt directory (every rank's log
and progress file live there): when nothing in it has changed for N seconds, it asks each live
rank for its Python stacks (daemon/stacks.py), waits STACKS_WAIT for them, and tears the group
down as failed. The root-cause error is "Stalled", its traceback the ranks' stacks, and
max_restarts applies as to any failure.
"""

from __future__ import annotations

import os
from pathlib import Path

from .stacks import dump_of, who

STACKS_WAIT = 1.5   # seconds for the signalled ranks to write their stacks before the teardown


def activity(directory: Path) -> tuple:
    """What the ranks have written so far: (name, size, mtime) of every file in the attempt
    directory. It changes whenever a rank logs a line or reports progress."""
    try:
        with os.scandir(directory) as it:
            return tuple(sorted((e.name, s.st_size, s.st_mtime_ns) for e in it if e.is_file()
                                for s in (e.stat(),)))
    except OSError:
        return ()


def error_record(group, host: str) -> dict:
    """The root-cause error of a stalled attempt (a supervisor.Group whose `stall` is set)."""
    asked, parts = group.stall["asked"], []
    for a in asked:
        if "offset" in a:
            parts.append(f"{who(a)} (pid {a['pid']}):\n{dump_of(a) or '(it wrote no stacks in time)'}")
        elif a["skipped"] != "not running":
            parts.append(f"{who(a)} (pid {a['pid']}): no stacks: {a['skipped']}")
    live = [a for a in asked if a.get("skipped") != "not running"]
    first = next((a for a in live if "offset" in a), live[0] if live else asked[0] if asked else {})
    return {
        "rank": first.get("rank"), "pid": first.get("pid"), "host": host, "type": "Stalled",
        "message": (f"no rank wrote a log line or progress for {group.stall['quiet']:.0f} s "
                    f"(stages.{group.stage}.stall_timeout = {group.stall_timeout:g}); the live ranks' stacks follow"),
        "traceback": "\n\n".join(parts), "time_": group.stall["time"], "source": "stall",
        "path": first.get("log_path"),
    }
