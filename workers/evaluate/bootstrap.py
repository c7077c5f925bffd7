"""The evaluate stage's intervals: a percentile bootstrap over prompts. Pure Python, no vLLM,
no numpy, deterministic (random.Random with a fixed seed).

Each figure is a ratio of sums over prompts, as vLLM defines it: acceptance length
1 + accepted / drafts, the rate at draft position i accepted_per_pos[i] / drafts. A prompt's
drafts are not independent of each other (one prompt's answer is easy or hard throughout), so
the unit resampled is the prompt, never the draft: `resamples` times, draw as many units as
there are, with replacement, and compute each figure on the draw; the interval is the
(1 - level) / 2 and (1 + level) / 2 quantiles of those figures.

Units may be groups of prompts (several turns of one held-out chat are one unit: they share a
topic and a style, so they are not independent either); a unit's counts are its prompts'
sums.

The trained and untrained drafts answered the same prompts (speculative decoding is lossless),
so the gain (trained - untrained) is bootstrapped paired: each draw takes the same units for
both, and the gain's interval is that of the differences, narrower than the two intervals
side by side would suggest when a prompt is easy or hard for both.

A draw whose units hold no draft at all (every drawn prompt ended before its first draft) has
no acceptance length; it is left out, and counted (`skipped`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

LEVEL = 0.95
RESAMPLES = 2000
SEED = 0

Counts = dict[str, Any]  # drafts, draft_tokens, accepted, accepted_per_pos: the counters' shape


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile of ascending values, linearly interpolated (numpy's default)."""
    if not sorted_values:
        raise ValueError("no values")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def interval(values: Sequence[float], level: float = LEVEL) -> list[float]:
    """[lo, hi]: the central `level` of the values."""
    ordered = sorted(values)
    tail = (1.0 - level) / 2
    return [quantile(ordered, tail), quantile(ordered, 1.0 - tail)]


def sum_counts(items: Sequence[Counts], k: int) -> Counts:
    out: Counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0] * k}
    for c in items:
        out["drafts"] += c["drafts"]
        out["draft_tokens"] += c["draft_tokens"]
        out["accepted"] += c["accepted"]
        for i, n in enumerate(c["accepted_per_pos"][:k]):
            out["accepted_per_pos"][i] += n
    return out


def units(per_prompt: Sequence[Counts], groups: Sequence[Any] | None, k: int) -> list[Counts]:
    """The resampled units: one per prompt, or one per group (in the order groups first appear)."""
    if groups is None:
        return [sum_counts([c], k) for c in per_prompt]
    if len(groups) != len(per_prompt):
        raise ValueError(f"{len(groups)} groups for {len(per_prompt)} prompts")
    members: dict[Any, list[Counts]] = {}
    for g, c in zip(groups, per_prompt):
        members.setdefault(g, []).append(c)
    return [sum_counts(cs, k) for cs in members.values()]


def bootstrap(
    drafts: dict[str, Sequence[Counts]],
    k: int,
    groups: Sequence[Any] | None = None,
    *,
    paired: tuple[str, str] | None = None,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    level: float = LEVEL,
) -> dict[str, Any]:
    """Intervals of each draft's acceptance length and per-position rates, and with `paired` =
    (a, b) of the gain a - b, from the same draws.

    `drafts`: {label: per-prompt counts}, every label over the same prompts in the same order;
    `groups`: each prompt's unit (None: each prompt its own). Returns {label: {"acceptance_length":
    [lo, hi], "per_position": [[lo, hi], ...]}, "gain": [lo, hi] (with `paired`), "units": n,
    "resamples", "seed", "level", "skipped"}; a figure with no draw behind it is None."""
    labels = list(drafts)
    n_prompts = {len(v) for v in drafts.values()}
    if len(n_prompts) != 1:
        raise ValueError(f"the drafts were measured on different numbers of prompts: {sorted(n_prompts)}")
    per_label = {label: units(drafts[label], groups, k) for label in labels}
    n = len(next(iter(per_label.values())))
    # Flat columns per label: drafts, accepted, accepted at each position.
    cols = {
        label: (
            [u["drafts"] for u in us],
            [u["accepted"] for u in us],
            [[u["accepted_per_pos"][i] for u in us] for i in range(k)],
        )
        for label, us in per_label.items()
    }
    lengths: dict[str, list[float]] = {label: [] for label in labels}
    positions: dict[str, list[list[float]]] = {label: [[] for _ in range(k)] for label in labels}
    gains: list[float] = []
    skipped = 0
    rng = random.Random(seed)
    for _ in range(resamples if n else 0):
        draw = [rng.randrange(n) for _ in range(n)]
        figures = {}
        for label in labels:
            d_col, a_col, pos_cols = cols[label]
            d = sum(d_col[j] for j in draw)
            if d <= 0:
                break
            figures[label] = (1.0 + sum(a_col[j] for j in draw) / d, [sum(c[j] for j in draw) / d for c in pos_cols])
        else:
            for label, (length, rates) in figures.items():
                lengths[label].append(length)
                for i, r in enumerate(rates):
                    positions[label][i].append(r)
            if paired is not None:
                gains.append(figures[paired[0]][0] - figures[paired[1]][0])
            continue
        skipped += 1
    out: dict[str, Any] = {
        label: {
            "acceptance_length": interval(lengths[label], level) if lengths[label] else None,
            "per_position": [interval(p, level) if p else None for p in positions[label]],
        }
        for label in labels
    }
    if paired is not None:
        out["gain"] = interval(gains, level) if gains else None
    out.update(units=n, resamples=resamples, seed=seed, level=level, skipped=skipped)
    return out
