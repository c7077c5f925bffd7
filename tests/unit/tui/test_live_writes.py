"""tui/live.py: the ranks' last writes from the daemon's metric events, newer than the store's."""

from __future__ import annotations

from eyas.tui.live import Live
from eyas.wire.protocol import Event


def metric(run_id: int, stage: str, attempt: int, writes: dict) -> Event:
    return Event(
        1, "metric", {"run_id": run_id, "stage": stage, "attempt": attempt, "samples": [], "last_write": writes}
    )


def test_the_newest_last_write_of_events_or_store_wins_and_ends_with_the_stage():
    live = Live()
    changes = live.apply([metric(3, "train", 1, {"0": 1000.5, "1": 990.0}), metric(3, "train", 1, {"0": 1001.5})])
    assert changes.metrics == {3}
    stored = [{"rank": 0, "last_write": 1000.0}, {"rank": 1, "last_write": 995.0}, {"rank": 2, "last_write": None}]
    # Rank 0: the event's is newer; rank 1: the store's is (the event was older); rank 2: none sent.
    assert live.with_writes(3, "train", 1, stored) == [
        {"rank": 0, "last_write": 1001.5},
        {"rank": 1, "last_write": 995.0},
        {"rank": 2, "last_write": None},
    ]
    assert stored[0]["last_write"] == 1000.0  # the caller's rows are left as they are
    assert live.with_writes(3, "train", 2, stored) == stored  # another attempt's writes do not apply
    # Garbage from the wire is ignored, not raised on.
    live.apply([metric(3, "train", 1, {"x": 5.0, "0": "soon"})])
    assert live.with_writes(3, "train", 1, stored)[0]["last_write"] == 1001.5
    # The stage ended: its live writes go with its other live figures.
    live.apply([Event(1, "state", {"run_id": 3, "stage": "train", "entity": "stage", "to_state": "failed"})])
    assert live.with_writes(3, "train", 1, stored) == stored
