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


def nbytes(n: float) -> str:
    """Bytes in the largest binary unit under them: `512 B`, `3.0 KiB`, `132.7 MiB`, `74.8 GiB`."""
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def short(v: float) -> str:
    """A figure as it reads: a whole number as a count (`160`, `155,136`), else about four
    significant digits, `6.9k` style past a thousand (`48.2k`, `1.39M`), `3.742`, `2e-05`."""
    if abs(v) == int(abs(v)) and abs(v) < 1e15:
        return f"{v:,.0f}"
    return rate(v)


def rate(v: float) -> str:
    """A rate in three significant digits past a thousand (`6.9k`, `48.2k`, `1.39M`), else
    four (`312.5`, `0.25`)."""
    a = abs(v)
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{v:.4g}"


def metric(name: str, value: float | None) -> str:
    """A stored metric's value in the unit its name says: `*_bytes` (and a GPU's `mem_used`,
    `mem_total`) as sizes, `*_s` as durations (but `*tok_s`, a rate, as `6.9k`),
    `*_percent` and `progress` as percentages, anything else as a short figure; blank when
    unknown."""
    if value is None:
        return ""
    last = name.rsplit(".", 1)[-1]
    if last.endswith("_bytes") or last in ("mem_used", "mem_total"):
        return nbytes(value)
    if last.endswith("tok_s") or last.endswith("_per_s"):
        return rate(value)
    if last.endswith("_s"):
        return f"{value:.3g}s" if abs(value) < 10 else duration(value)
    if last.endswith("_percent") or last == "util":
        return f"{value:.0f}%"
    if last == "progress":
        return f"{value:.1%}"
    return short(value)
