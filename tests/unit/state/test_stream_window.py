"""A streaming run's window as `eyas show` and the TUI read it (state/queries/streaming.py: stream_window,
window_lines): its peak is the ledger's, which extract's ranks report as window_peak_bytes and
its summary too, not the largest of the sampled window_bytes."""

from __future__ import annotations

from eyas.state import paths, queries, store

MiB = 2**20
BUDGET = 24 * MiB


def _run(home, samples: dict[int, list[dict]]) -> int:
    """A streaming run whose extract ranks wrote `samples` (rank: progress metrics, in time order),
    stored as the daemon's sampler stores them: a row per numeric field."""
    db = store.open_writer(paths.db_path(home))
    cfg = {"pipeline": ["extract", "train"], "storage": {"mode": "streaming", "budget_gb": BUDGET / 1e9}}
    run_id = store.create_run(db, name="s", model="m", stages=[{"name": "extract"}, {"name": "train"}], config=cfg)
    store.move_run(db, run_id, "running", "started")
    store.move_stage(db, run_id, "extract", "running", "started")
    store.new_attempt(db, run_id, "extract", dir=str(home / "a"), world_size=len(samples))
    rows = [
        {"time": 1000.0 + t, "run_id": run_id, "stage": "extract", "attempt": 1, "rank": rank, "name": k, "value": v}
        for rank, records in samples.items()
        for t, fields in enumerate(records)
        for k, v in {"window_budget": BUDGET, **fields}.items()
    ]
    store.insert_metrics(db, rows)
    db.conn.close()
    return run_id


def _window(home, run_id: int) -> dict:
    conn = queries.connect(paths.db_path(home))
    try:
        return queries.stream_window(conn, run_id)
    finally:
        conn.close()


def test_the_peak_is_the_ledgers_which_the_samples_of_the_windows_bytes_missed(tmp_path):
    # The window reached 11 MiB between two samples (a shard landed, train freed a step); the
    # ledger counted it, and every later sample carries it, as does the summary (producer.peak).
    samples = {
        0: [
            {"window_bytes": 6 * MiB, "window_peak_bytes": 6 * MiB},
            {"window_bytes": 9 * MiB, "window_peak_bytes": 11 * MiB},
            {"window_bytes": 4 * MiB, "window_peak_bytes": 11 * MiB},
        ],
        1: [{"window_bytes": 10 * MiB, "window_peak_bytes": 10 * MiB}],
    }
    window = _window(tmp_path, _run(tmp_path, samples))
    assert (window["peak"], window["bytes"], window["budget"]) == (11 * MiB, 4 * MiB, BUDGET)
    assert (
        queries.window_lines(window)[0] == "window: 4.0 MiB (17%) last sampled, 11.0 MiB (46%) at most, budget 24.0 MiB"
    )

    # A run recorded before the ledger kept its peak has only the samples: the largest of them.
    old = _run(tmp_path, {0: [{"window_bytes": 6 * MiB}, {"window_bytes": 9 * MiB}], 1: [{"window_bytes": 3 * MiB}]})
    assert _window(tmp_path, old)["peak"] == 9 * MiB
