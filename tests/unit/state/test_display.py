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


def test_metric_values_read_in_their_units():
    cases = [
        ("gpu_mem_bytes", 1.39149e08, "132.7 MiB"),
        ("rss_bytes", 512, "512 B"),
        ("gpu0.mem_used", 7e10, "65.2 GiB"),
        ("window_bytes", 3 * 2**40, "3.0 TiB"),
        ("tok_s", 6896.5, "6.9k"),
        ("tok_s", 13000.0, "13k"),
        ("step_tok_s", 950.25, "950.2"),
        ("eta_s", 1460, "24m20s"),
        ("eta_s", 0, "0s"),
        ("extract_wait_s", 0.25, "0.25s"),
        ("cpu_percent", 312.4, "312%"),
        ("progress", 0.523, "52.3%"),
        ("samples", 2160.0, "2,160"),
        ("loss", 3.742153, "3.742"),
        ("lr", 1.935e-05, "1.935e-05"),
        ("acc_0", 0.37091, "0.3709"),
        ("loss", None, ""),
    ]
    assert [display.metric(name, v) for name, v, _ in cases] == [want for _, _, want in cases]
