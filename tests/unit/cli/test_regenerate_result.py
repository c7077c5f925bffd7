"""The regenerate stage's row in the run's summary table (`eyas submit --follow`, `eyas demo`):
what the later stages train on, the target's own answers, and what cut them short."""

from __future__ import annotations

from eyas.cli.follow import result

SUMMARY = {
    "rows": 300,
    "rows_out": 300,
    "rows_finished": 296,
    "rows_cut_max_tokens": 4,
    "rows_cut_max_length": 0,
    "rows_failed": 0,
    "failed": {},
    "turns": 585,
    "turns_by_end": {"stop": 581, "max_tokens": 4},
    "tokens_generated": 6123,
    "trainable_tokens": 6700,
    "tokens": 31000,
}


def test_the_row_says_how_many_rows_the_target_answered_and_what_cut_them_short():
    assert result("regenerate", SUMMARY) == (
        "300 of 300 rows answered by the target, 585 turns, 6,123 tokens, 4 with a turn cut at max_tokens"
    )
    some_failed = dict(SUMMARY, rows_out=298, rows_failed=2, rows_cut_max_length=1)
    assert result("regenerate", some_failed) == (
        "298 of 300 rows answered by the target, 585 turns, 6,123 tokens, 4 with a turn cut at max_tokens, "
        "1 cut at max_length, 2 failed"
    )


def test_a_summary_without_counts_shows_nothing():
    assert result("regenerate", None) == "" and result("regenerate", {"attempt": {}}) == ""
