"""The settlement policy, row by row, with no daemon and no store (daemon/verdict.py)."""

from __future__ import annotations

import pytest

from eyas.daemon.verdict import Ending, Restart, Sibling, StageRecord, Verdict, decide
from eyas.state import specs

END = 1000.0
TRAIN = StageRecord("train", restarts=0, max_restarts=2, backoff=1.5)
TEARDOWN = f"{specs.SIBLING_TEARDOWN}train failed"


def failed(why="rank 0 failed: ValueError: boom", final=False, cancel=None) -> Ending:
    return Ending(why, final, cancel, END)


def extract_sibling(live=True, state="running", restart_at=None, reason=None) -> Sibling:
    return Sibling("extract", live, state, reason, restart_at)


def test_a_failure_with_restarts_left_restarts_after_its_backoff_doubling_each_time():
    first = decide(failed(), TRAIN, stopping=False)
    assert first == Verdict(
        "failed",
        "rank 0 failed: ValueError: boom",
        restart=Restart(1, END + 1.5, spends=True),
        restart_note="restart 1 of 2 in 1.5s after rank 0 failed: ValueError: boom",
    )
    second = decide(failed(), StageRecord("train", 1, 2, 1.5), stopping=False)
    assert second.restart == Restart(2, END + 3.0, spends=True) and second.stage is None and second.run is None
    assert second.restart_note.startswith("restart 2 of 2 in 3.0s after ")


@pytest.mark.parametrize(
    "ending, record, stopping",
    [
        (failed(), StageRecord("train", 2, 2, 1.5), False),  # no restart left
        (failed(), StageRecord("train", 0, 0, 1.5), False),  # none allowed
        (failed(final=True), TRAIN, False),  # the stage's word: a rerun fails the same way
        (failed(cancel="stopped by the user"), TRAIN, False),  # failed while being stopped
        (failed(), TRAIN, True),  # the daemon is stopping
    ],
    ids=["restarts-spent", "no-restarts", "final", "stop-asked", "daemon-stopping"],
)
def test_a_failure_that_does_not_restart_fails_the_stage_and_the_run_in_its_words(ending, record, stopping):
    assert decide(ending, record, stopping) == Verdict(
        "failed",
        ending.failure,
        stage="failed",
        stage_reason=ending.failure,
        keeps_summary=True,
        run="failed",
        run_reason=f"train: {ending.failure}",
    )


def test_a_failed_half_leaves_the_runs_end_to_its_live_sibling():
    found = decide(failed(), StageRecord("train", 2, 2, 1.0), False, extract_sibling(live=True))
    assert (found.stage, found.run, found.run_reason) == ("failed", None, None)
    # Its sibling gone, the run ends with it.
    found = decide(failed(), StageRecord("train", 2, 2, 1.0), False, extract_sibling(live=False))
    assert (found.run, found.run_reason) == ("failed", "train: rank 0 failed: ValueError: boom")


def test_a_half_torn_down_for_its_sibling_restarts_with_it_spending_no_restart():
    record = StageRecord("extract", restarts=1, max_restarts=1, backoff=9.0)
    sibling = Sibling("train", False, "running", "restart 1 of 1", END + 4.0)
    found = decide(Ending(None, False, TEARDOWN, END), record, False, sibling)
    assert found == Verdict(
        "cancelled",
        TEARDOWN,
        restart=Restart(1, END + 4.0, spends=False),  # the sibling's due time, its own count kept
        restart_note=f"restarts with train: {TEARDOWN}",
    )


@pytest.mark.parametrize(
    "sibling, stopping",
    [
        (Sibling("train", False, "failed", "rank 0 failed: SIGKILL", None), False),  # no restart due
        (Sibling("train", False, "running", "rank 0 failed: SIGKILL", END + 4.0), True),  # stopping
    ],
    ids=["sibling-failed", "daemon-stopping"],
)
def test_a_half_torn_down_for_a_sibling_that_does_not_restart_is_cancelled_and_the_run_fails_in_its_words(
    sibling, stopping
):
    record = StageRecord("extract", 0, 3, 1.0)
    found = decide(Ending(None, False, TEARDOWN, END), record, stopping, sibling)
    assert found == Verdict(
        "cancelled",
        TEARDOWN,
        stage="cancelled",
        stage_reason=TEARDOWN,
        run="failed",
        run_reason="train: rank 0 failed: SIGKILL",
    )


def test_a_sibling_teardown_without_a_sibling_is_refused():
    with pytest.raises(ValueError, match="does not have"):
        decide(Ending(None, False, TEARDOWN, END), StageRecord("vocab", 0, 0, 1.0), False)


def test_a_stop_cancels_the_attempt_the_stage_and_the_run_unless_a_sibling_lives():
    stop = Ending(None, False, "stopped by the user", END)
    assert decide(stop, TRAIN, False) == Verdict(
        "cancelled",
        "stopped by the user",
        stage="cancelled",
        stage_reason="stopped by the user",
        run="cancelled",
        run_reason="train: stopped by the user",
    )
    found = decide(stop, TRAIN, False, extract_sibling(live=True))
    assert (found.stage, found.run) == ("cancelled", None)


def test_every_rank_exiting_0_succeeds_whatever_the_restarts_or_the_stopping():
    for record, stopping in ((TRAIN, False), (StageRecord("train", 2, 2, 1.0), True)):
        assert decide(Ending(None, False, None, END), record, stopping) == Verdict(
            "succeeded",
            "every rank exited 0",
            stage="succeeded",
            stage_reason="every rank exited 0",
            keeps_summary=True,
        )
