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

from .stacks import read_from, stacks_from

STACKS_WAIT = 1.5   # seconds for the signalled ranks to write their stacks before the teardown


def timeout_of(cfg: dict, stage: str) -> float:
    """stages.<stage>.stall_timeout from a run's config JSON; 0 (off) when unset."""
    return float(((cfg.get("stages") or {}).get(stage) or {}).get("stall_timeout") or 0.0)


def activity(directory: Path) -> tuple:
    """What the ranks have written so far: (name, size, mtime) of every file in the attempt
    directory. It changes whenever a rank logs a line or reports progress."""
    try:
        with os.scandir(directory) as it:
            return tuple(sorted((e.name, s.st_size, s.st_mtime_ns) for e in it if e.is_file()
                                for s in (e.stat(),)))
    except OSError:
        return ()


def error_record(stall: dict, stage: str, host: str) -> dict:
    """The root-cause error of a stalled attempt, from what stacks.request returned."""
    asked = stall["asked"]
    parts, first = [], None
    for a in asked:
        who = f"TP worker {a['tp_rank']}" if a.get("role") == "tp-worker" else f"rank {a['rank']}"
        if "offset" in a:
            dump = stacks_from(read_from(Path(a["log_path"]), a["offset"]))
            parts.append(f"{who} (pid {a['pid']}):\n{dump or '(it wrote no stacks in time)'}")
            first = first or a
        elif a.get("skipped") != "not running":
            parts.append(f"{who} (pid {a['pid']}): no stacks: {a['skipped']}")
    first = first or next((a for a in asked if a.get("skipped") != "not running"), asked[0] if asked else {})
    return {
        "rank": first.get("rank"), "pid": first.get("pid"), "host": host, "type": "Stalled",
        "message": (f"no rank wrote a log line or progress for {stall['quiet']:.0f} s "
                    f"(stages.{stage}.stall_timeout = {stall['timeout']:g}); the live ranks' stacks follow"),
        "traceback": "\n\n".join(parts), "time_": stall["time"], "source": "stall",
        "path": first.get("log_path"),
    }

