"""How stored values read to a person: times, durations, sizes and counts.

Shared by the CLI listings and the TUI, so both print the same figures the same way.
Stdlib only."""

from __future__ import annotations

import signal
import time
from datetime import UTC, datetime


def iso_utc(t: float | None) -> str | None:
    """A unix time as ISO 8601 in UTC (`2026-12-02T13:05:01+00:00`); None stays None."""
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat()


def local_minute(t: float | None) -> str:
    """A unix time as local `YYYY-MM-DD HH:MM`; blank when unknown."""
    return "" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def local_second(t: float | None) -> str:
    return "" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def duration(seconds: float | None) -> str:
    """`12s`, `3m05s`, `1h02m`, `2d03h`: two units at most; blank when unknown."""
    if seconds is None:
        return ""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def size(nbytes: float | None) -> str:
    """Bytes as `12.3 GiB` (MiB below one GiB); blank when unknown."""
    if nbytes is None:
        return ""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def count(x: float | None) -> str:
    """A rate or count rounded, with thousands separators (`1,234`); blank when unknown."""
    return "" if x is None else f"{round(x):,}"


def exit_text(rank: dict) -> str:
    """How a rank ended: `exit 1`, `SIGKILL`, `SIGKILL (OOM)`; blank while it runs."""
    sig = rank.get("signal")
    oom = " (OOM)" if rank.get("oom_killed") else ""
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return name + oom
    if rank.get("exit_code") is not None:
        return f"exit {rank['exit_code']}" + oom
    return ""


def rank_label(rank: dict) -> str:
    """Who a rank or error record is: `rank 2`, or `rank 2 (TP worker 1)` for a vLLM
    driver's tensor-parallel worker (role "tp-worker"), as the TUI and the CLI both name it."""
    label = f"rank {'–' if rank.get('rank') is None else rank['rank']}"
    if rank.get("role") == "tp-worker":
        label += f" (TP worker {'?' if rank.get('tp_rank') is None else rank['tp_rank']})"
    return label
