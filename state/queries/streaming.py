"""A streaming run's window of hidden states between extract and train, as the ranks' progress metrics tell it, and in the lines `eyas show` and the TUI's Run screen write."""

from __future__ import annotations

import json
from typing import Any

from eyas.state import display


def streams(config_json: str | None) -> bool:
    """Whether a run's config JSON (runs.config_json) streams its hidden states from extract to train."""
    try:
        return (json.loads(config_json or "{}").get("storage") or {}).get("mode") == "streaming"
    except ValueError:
        return False


def stream_window(db, run_id: int) -> dict[str, Any] | None:
    """A streaming run's window (workers/extract/stream.py), from the ranks' progress metrics:
    its bytes now and at its peak, its budget, and how often (and how long) each side waited on
    the other, over every attempt; its mode ("keep", "window", or None while not known) and the
    dataset's size when known; None for a run that never streamed.

    Every figure is an index probe or a walk of one series of one attempt: the TUI's Run screen
    reads this each second while the run goes on, beside train's millions of samples."""
    attempts = {
        stage: [n for (n,) in db.execute("SELECT number FROM attempts WHERE run_id=? AND stage=?", [run_id, stage])]
        for stage in ("extract", "train")
    }

    def per_rank(stage: str, name: str) -> list[float]:
        """Each (attempt, rank)'s largest sample of `name`."""
        return [
            v
            for a in attempts[stage]
            for _, v in db.execute(
                "SELECT rank, MAX(value) FROM metrics WHERE run_id=? AND stage=? AND attempt=? AND name=? GROUP BY rank",
                [run_id, stage, a, name],
            )
            if v is not None
        ]

    budgets = per_rank("extract", "window_budget")
    if not budgets:
        return None
    now = None
    for a in attempts["extract"]:
        row = db.execute(
            "SELECT time, value FROM metrics WHERE run_id=? AND stage='extract' AND attempt=? AND name='window_bytes' "
            "ORDER BY time DESC LIMIT 1",
            [run_id, a],
        ).fetchone()
        if row and (now is None or row[0] > now[0]):
            now = row
    # The peak is the window's ledger's own (workers/extract/stream.py: Ledger), which every
    # sample carries as window_peak_bytes and extract's summary reports: the largest of the
    # sampled window_bytes misses the moments between samples. Runs recorded before the
    # ledger kept it have only those samples.
    peaks = per_rank("extract", "window_peak_bytes") or per_rank("extract", "window_bytes")
    out: dict[str, Any] = {
        "budget": max(budgets),
        "peak": max(peaks, default=None),
        "bytes": now[1] if now else None,
    }
    # Counts are cumulative per rank and attempt: each (attempt, rank)'s last value, summed.
    for stage in ("extract", "train"):
        for what in ("waits", "wait_s"):
            out[f"{stage}_{what}"] = float(sum(per_rank(stage, f"{stage}_{what}")))
    out["mode"], out["dataset_bytes"] = _stream_mode(db, run_id, attempts["train"])
    return out


def _stream_mode(db, run_id: int, train_attempts: list[int]) -> tuple[str | None, float | None]:
    """(mode, dataset bytes) of a streaming run. Extract's rank 0 chooses the mode once and its
    summary says which (train's too); before either stage ends, a shard train freed says
    "window", since keep mode never frees one. None for what is not known yet."""
    summaries = {
        name: json.loads(text)
        for name, text in db.execute(
            "SELECT name, summary_json FROM stages WHERE run_id=? AND name IN ('extract', 'train') "
            "AND summary_json IS NOT NULL",
            [run_id],
        )
    }
    ex, tr = (x if isinstance(x := summaries.get(name), dict) else {} for name in ("extract", "train"))
    mode = ex.get("streaming") or tr.get("streaming")
    if mode is None:
        freed = any(
            db.execute(
                "SELECT 1 FROM metrics WHERE run_id=? AND stage='train' AND attempt=? AND name='shards_freed' "
                "AND value > 0 LIMIT 1",
                [run_id, a],
            ).fetchone()
            for a in train_attempts
        )
        mode = "window" if freed else None
    return mode, ex.get("dataset_bytes")


def window_lines(window: dict[str, Any] | None) -> list[str]:
    """A streaming run's window (stream_window) as `eyas show` and the TUI's Run screen write it:
    its size when last sampled and at its peak, each as a share of the budget, whether the
    dataset is kept or made again each epoch, and each side's waits on the other; [] without a
    window. Short lines: each fits the TUI's 80 columns unwrapped."""
    if not window:
        return []
    budget = window["budget"]

    def part(n: float | None) -> str:
        if n is None:
            return "–"
        return f"{display.size(n)} ({n / budget:.0%})" if budget else display.size(n)

    dataset = f" ({display.size(window['dataset_bytes'])})" if window.get("dataset_bytes") is not None else ""
    mode = {
        "keep": f"kept: the whole dataset{dataset} fits, later epochs read it from disk",
        "window": f"regenerated each epoch: the dataset{dataset} does not fit the budget",
    }.get(window.get("mode"), "kept or regenerated each epoch: not known yet")
    return [
        f"window: {part(window['bytes'])} last sampled, {part(window['peak'])} at most, budget {display.size(budget)}",
        mode,
        f"waits: extract on the window {int(window['extract_waits'])}x ({window['extract_wait_s']:.1f} s), "
        f"train on extract {int(window['train_waits'])}x ({window['train_wait_s']:.1f} s)",
    ]
