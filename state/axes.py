"""The arithmetic of a readable curve, shared by the TUI's plots and `eyas show --plot`: round ticks on linear, log and elapsed-time axes, their labels in the units people read, and TensorBoard's EMA smoothing.

Which curves read better on a log axis or smoothed is said here too (`LOG_Y`, `SMOOTHED`), so
that both front ends draw a curve the same way. Stdlib only: the CLI and the TUI import it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Curves (queries.CURVES keys) drawn on a log y axis by default: a loss falls by decades, and
# on a linear axis its first points (9.3 at step 0) flatten everything after them.
LOG_Y = frozenset({"loss", "val_loss"})
# Curves smoothed by default: one figure per step (loss, accuracy per TTT step) or per second
# (tok/s) is a cloud; the trend is what is read, with the raw series faint behind it.
SMOOTHED = frozenset({"loss", "acc", "tok_s"})
# TensorBoard's default smoothing weight; the front ends offer off, this, and STRONG.
DEFAULT_SMOOTHING = 0.6
STRONG_SMOOTHING = 0.9
SMOOTHING_LEVELS = (0.0, DEFAULT_SMOOTHING, STRONG_SMOOTHING)


def nice_ticks(lo: float, hi: float, most: int) -> list[float]:
    """At most `most` round values (1, 2 or 5 times a power of ten apart) within [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or most < 1:
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, most - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    ticks, v = [], first
    while v <= hi + step * 1e-9 and len(ticks) < most + 1:
        ticks.append(0.0 if abs(v) < step * 1e-9 else v)
        v += step
    return ticks[:most] if len(ticks) > most else ticks


def log_ticks(lo: float, hi: float, most: int) -> list[float]:
    """Round values for a log axis over [lo, hi] (both > 0): powers of ten, then 2 and 5 times
    them when there is room, at most `most`; within a decade, the linear ticks instead."""
    if not (lo > 0 and hi > 0 and math.isfinite(lo) and math.isfinite(hi)) or most < 1:
        return []
    if hi <= lo:
        return [lo]
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    for mantissas in ((1, 2, 5), (1, 3), (1,)):
        ticks = [m * 10.0**e for e in range(first, last + 1) for m in mantissas]
        ticks = [t for t in ticks if lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)]
        if 2 <= len(ticks) <= most:
            return ticks
    powers = [10.0**e for e in range(first, last + 1) if lo * (1 - 1e-9) <= 10.0**e <= hi * (1 + 1e-9)]
    if len(powers) > most:  # many decades: every k-th power of ten
        k = math.ceil(len(powers) / most)
        return powers[::k]
    # Less than a decade or so: round linear values read best, at their log positions.
    ticks = [t for t in nice_ticks(lo, hi, most) if t > 0]
    return ticks if len(ticks) >= 2 else [lo, hi]


def time_ticks(lo: float, hi: float, most: int) -> list[float]:
    """Round elapsed times: seconds, minutes or hours (1, 2, 5, 10, 15, 30 of the unit)."""
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / max(1, most - 1)
    steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 3 * 3600, 6 * 3600, 12 * 3600, 86400]
    step = next((s for s in steps if s >= raw), 86400 * math.ceil(raw / 86400))
    if most >= 2 and math.ceil(lo / step) * step + step > hi:
        # One tick says nothing of the scale: the largest round step that fits two.
        step = max((s for s in steps if s <= span / 1.5), default=step)
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) // step) + 1)][: most + 1]


def clock_unit(span: float) -> str:
    """How an elapsed-time axis spanning `span` seconds is labelled: "m:ss" under an hour,
    else "h:mm"."""
    return "m:ss" if span < 3600 else "h:mm"


def clock(seconds: float, unit: str = "h:mm") -> str:
    """Elapsed seconds as `m:ss` (`0:45`, `12:30`) or `h:mm` (`1:30`, `26:00`): a clock's
    face, the same on every tick of one axis (`clock_unit` picks it)."""
    s = int(round(seconds))
    sign, s = ("-", -s) if s < 0 else ("", s)
    if unit == "m:ss":
        m, r = divmod(s, 60)
        return f"{sign}{m}:{r:02d}"
    h, r = divmod(s, 3600)
    return f"{sign}{h}:{r // 60:02d}"


def number(v: float) -> str:
    """A tick value in at most about 5 characters: `0.012`, `2.5`, `950`, `6.9k`, `1.2M`."""
    a = abs(v)
    if a == 0:
        return "0"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= div:
            return f"{v / div:.3g}{suffix}"
    if a >= 1:
        return f"{v:.3g}"
    if a < 0.01:
        mantissa, _, exp = f"{v:.1e}".partition("e")
        return f"{mantissa}e{int(exp)}"  # 3e-4 rather than 0.0003: a learning rate stays short
    return f"{v:.2g}"


def ema(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average debiased for its start (so the
    first point is the first value, not a fraction of it). A weight of 0 returns the values;
    a non-finite value is passed through and left out of the average; a constant series stays
    as it is (no drift from float error)."""
    if weight <= 0 or not values:
        return list(values)
    if all(v == values[0] for v in values):
        return list(values)
    out, last, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last = last * weight + (1 - weight) * v
        n += 1
        out.append(last / (1 - weight**n) if weight < 1 else last)
    return out


def log_ready(values: Sequence[float]) -> bool:
    """Whether a series can be drawn on a log axis: every finite value above zero."""
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and min(finite) > 0


def gpu_note(attempts: Sequence[dict], daemon_gpu: bool | None = None) -> str:
    """What an empty GPU-memory plot of a stage says instead of a curve: "no GPUs on this
    host" when the daemon's NVML sees none (`daemon_gpu` False, from its status; None when
    unknown, as with no daemon), "no GPUs: this stage ran on CPU" when every attempt ran on
    no device (the scheduler gives none on a host without GPUs, for resources.devices =
    "cpu" and for stages that need none), else "no samples". A Slurm attempt has no devices
    of the daemon's but GPUs of its node's, so it is never said to have none."""
    slurm = any(a.get("slurm_job") for a in attempts)
    if daemon_gpu is False and not slurm:
        return "no GPUs on this host"
    if attempts and not slurm and not any(a.get("devices") for a in attempts):
        return "no GPUs: this stage ran on CPU"
    return "no samples"
