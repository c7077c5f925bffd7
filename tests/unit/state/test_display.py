"""state/display.py: how a rank is named, the same in the CLI and the TUI."""

from __future__ import annotations

from eyas.state import display


def test_rank_label_names_tp_workers_by_their_tp_rank():
    cases = [
        ({"rank": 0, "role": None, "tp_rank": None}, "rank 0"),
        ({"rank": 0, "role": "driver", "tp_rank": None}, "rank 0"),
        ({"rank": 2, "role": "tp-worker", "tp_rank": 1}, "rank 2 (TP worker 1)"),
        ({"rank": None, "role": None, "tp_rank": None}, "rank –"),
        ({"rank": 3, "role": "tp-worker", "tp_rank": None}, "rank 3 (TP worker ?)"),
    ]
    assert [display.rank_label(r) for r, _ in cases] == [want for _, want in cases]
