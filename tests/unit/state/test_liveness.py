"""state/liveness.py: ages, the quiet threshold and the line on a stage's ranks."""

from __future__ import annotations

import pytest

from eyas.state import liveness

NOW = 1_000_000.0


def rank(n: int, state: str = "running", wrote: float | None = None, **fields) -> dict:
    """A rank row as queries.get_run gives it; `wrote` is seconds before NOW."""
    return {"rank": n, "state": state, "last_write": None if wrote is None else NOW - wrote, **fields}


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, ""), (-3, "0s"), (0, "0s"), (4.9, "4s"), (59.99, "59s"), (60, "1m"), (192, "3m"), (3599, "59m")]
    + [(3600, "1h"), (7322, "2h"), (86399, "23h"), (86400, "1d"), (5 * 86400 + 7, "5d")],
)
def test_ago_is_one_unit_rounded_down(seconds, text):
    assert liveness.ago(seconds) == text


@pytest.mark.parametrize(
    ("env", "after"),
    [({}, 60.0), ({"EYAS_QUIET_AFTER": "5"}, 5.0), ({"EYAS_QUIET_AFTER": "2.5"}, 2.5)]
    + [({"EYAS_QUIET_AFTER": "0"}, 60.0), ({"EYAS_QUIET_AFTER": "-1"}, 60.0), ({"EYAS_QUIET_AFTER": "soon"}, 60.0)],
)
def test_quiet_after_defaults_to_a_minute_and_takes_a_positive_override(env, after):
    assert liveness.QUIET_AFTER_S == 60.0
    assert liveness.quiet_after(env) == after


def test_idle_and_quiet_count_from_the_last_write_and_only_for_running_ranks():
    assert liveness.idle(rank(0, wrote=12.5), NOW) == 12.5
    assert liveness.idle(rank(0, wrote=None), NOW) is None  # an older daemon kept none: unknown
    assert liveness.idle({"rank": 0, "state": "running", "last_write": NOW + 3}, NOW) == 0.0  # a clock a bit ahead
    assert liveness.is_quiet(rank(0, wrote=60), NOW, 60)  # at the threshold
    assert not liveness.is_quiet(rank(0, wrote=59.9), NOW, 60)
    assert not liveness.is_quiet(rank(0, wrote=None), NOW, 60)
    assert not liveness.is_quiet(rank(0, "exited", wrote=600, exit_code=0), NOW, 60)  # ended: not quiet, gone
    ranks = [rank(0, wrote=200), rank(1, wrote=30), rank(2, "exited", wrote=1)]
    assert liveness.stage_idle(ranks, NOW) == 30  # the running rank that wrote last
    assert liveness.stage_idle([rank(0, wrote=None)], NOW) is None


@pytest.mark.parametrize(
    ("numbers", "text"),
    [
        ([3], "rank 3"),
        ([1, 0], "ranks 0, 1"),
        ([0, 1, 2, 5], "ranks 0-2, 5"),
        ([7, 2, 3, 4, 9, 10], "ranks 2-4, 7, 9, 10"),
    ],
)
def test_rank_list_joins_runs(numbers, text):
    assert liveness.rank_list(numbers) == text


def test_the_hung_rank_line_names_the_exited_and_the_quiet_rank():
    ranks = [rank(0, wrote=190), rank(1, "exited", wrote=185, exit_code=0, ended_at=NOW - 185)]
    assert liveness.stage_note(ranks, NOW, 60) == "rank 1 exited 0 3m ago; rank 0 still running, quiet 3m"


def test_partly_exited_is_said_before_anyone_is_quiet():
    ranks = [rank(0, wrote=2), rank(1, wrote=1), rank(2, "exited", wrote=20, exit_code=0, ended_at=NOW - 20)]
    assert liveness.stage_note(ranks, NOW, 60) == "rank 2 exited 0 20s ago; ranks 0, 1 still running"


def test_quiet_ranks_without_exits_and_ends_grouped_by_how():
    ranks = [rank(r, wrote=90 + r) for r in range(4)] + [rank(4, wrote=1), rank(5, wrote=None)]
    assert liveness.stage_note(ranks, NOW, 60) == "ranks 0-3 quiet 1m"
    ranks = [
        rank(0, "failed", exit_code=1, ended_at=NOW - 5),
        rank(1, "killed", signal=15, ended_at=NOW - 3),
        rank(2, "killed", signal=15, ended_at=NOW - 2),
        rank(3, wrote=70),
    ]
    assert liveness.stage_note(ranks, NOW, 60) == (
        "rank 0 exited 1 5s ago; ranks 1, 2 killed by SIGTERM 2s ago; rank 3 still running, quiet 1m"
    )


def test_nothing_to_say_while_every_rank_runs_and_writes():
    assert liveness.stage_note([rank(0, wrote=3), rank(1, wrote=59), rank(2, wrote=None)], NOW, 60) == ""
    assert liveness.stage_note([], NOW, 60) == ""
