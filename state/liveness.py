"""Whether a rank is alive in the way that matters: how long since it last showed life
(`ranks.last_write`, kept by the daemon's sampler: a log line, a progress record, or inside a long
silent phase its evidence or its processes' CPU moving; a bare heartbeat does not count), whether
that counts as quiet, and one line for a stage whose ranks are quiet or have partly exited.

Shared by the TUI and the CLI, so both mark the same ranks the same way. Stdlib only.

A rank is quiet once it has shown no life for `quiet_after()` seconds: 60 by default
(QUIET_AFTER_S), `EYAS_QUIET_AFTER` overrides it. A working phase (a weight load, an engine
start-up, a checkpoint save) shows its evidence every 5 s (workers/runtime/progress.py), so a
healthy rank is never marked, while the mark comes long before a stage's stall_timeout (10
minutes and more) ends it. The mark only tells; the watchdog (daemon/stall.py) alone acts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .display import exit_text

QUIET_AFTER_S = 60.0
QUIET_ENV = "EYAS_QUIET_AFTER"


def quiet_after(environ: Mapping[str, str] = os.environ) -> float:
    """Seconds without a write after which a running rank is marked quiet: $EYAS_QUIET_AFTER
    when it is a positive number, else QUIET_AFTER_S."""
    try:
        value = float(environ.get(QUIET_ENV, ""))
    except ValueError:
        return QUIET_AFTER_S
    return value if value > 0 else QUIET_AFTER_S


def ago(seconds: float | None) -> str:
    """An age in its largest unit, rounded down: `4s`, `3m`, `2h`, `5d`; blank when unknown."""
    if seconds is None:
        return ""
    s = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def idle(rank: Mapping, now: float) -> float | None:
    """Seconds since the rank last wrote a log line or a progress record; None when unknown
    (a rank recorded by a daemon that kept no last_write)."""
    wrote = rank.get("last_write")
    return None if wrote is None else max(0.0, now - wrote)


def is_quiet(rank: Mapping, now: float, after: float) -> bool:
    """A running rank that has written nothing for `after` seconds."""
    quiet = idle(rank, now)
    return rank.get("state") == "running" and quiet is not None and quiet >= after


def stage_idle(ranks: list[Mapping], now: float) -> float | None:
    """How long since any of the running ranks wrote (the least quiet one's idle time); None
    when no running rank has a known last write."""
    times = [t for r in ranks if r.get("state") == "running" and (t := idle(r, now)) is not None]
    return min(times) if times else None


def rank_list(numbers: list[int]) -> str:
    """`rank 3`, `ranks 0-2, 5`: rank numbers with runs of consecutive ones joined."""
    numbers = sorted(numbers)
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" if b > a + 1 else f"{a}, {b}" for a, b in spans)
    return f"rank{'s' if len(numbers) != 1 else ''} {text}"


def _ending(rank: Mapping) -> str:
    """How an ended rank ended, as a verb: `exited 0`, `exited 1`, `killed by SIGTERM`."""
    sig = rank.get("signal")
    if sig:
        return f"killed by {exit_text(rank)}"
    code = rank.get("exit_code")
    return f"exited {code}" if code is not None else str(rank.get("state") or "ended")


def stage_note(ranks: list[Mapping], now: float, after: float) -> str:
    """One line on a running attempt's ranks, or "" when every rank runs and writes:

    `rank 1 exited 0 3m ago; rank 0 still running, quiet 3m` (partly exited), `ranks 0-3 quiet 2m`
    (none exited, some quiet). Ranks that ended alike are named together, with the latest end.
    """
    ended: dict[str, list[Mapping]] = {}
    running = []
    for r in ranks:
        if r.get("state") == "running":
            running.append(r)
        else:
            ended.setdefault(_ending(r), []).append(r)
    parts = []
    for how, group in ended.items():
        times = [r["ended_at"] for r in group if r.get("ended_at") is not None]
        when = f" {ago(now - max(times))} ago" if times else ""
        parts.append(f"{rank_list([r['rank'] for r in group])} {how}{when}")
    quiet = [r for r in running if is_quiet(r, now, after)]
    if quiet:
        still = " still running," if ended else ""
        parts.append(f"{rank_list([r['rank'] for r in quiet])}{still} quiet {ago(stage_idle(quiet, now))}")
    if ended and len(quiet) < len(running):
        parts.append(f"{rank_list([r['rank'] for r in running if r not in quiet])} still running")
    return "; ".join(parts) if ended or quiet else ""
