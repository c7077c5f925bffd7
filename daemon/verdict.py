"""The settlement policy as a pure function: what an attempt's end was, its stage's record and
limits, whether the daemon is stopping and where the streaming sibling stands, in; the verdict
that daemon/settle.py records, out.

No store, no daemon, no clock: the same facts give the same verdict, so every row of the
policy is tested on its own (tests/unit/daemon/test_verdict.py), and `settle.record` only
gathers the facts and writes what comes back.

The policy, in order:
1. A failure restarts the stage when the stop was not asked for, the stage did not call its
   failure final (a rerun fails the same way: evaluate's quality gate), restarts are left and
   the daemon is not stopping; the n-th restart is due `backoff * 2**(n-1)` after the end.
2. Any other failure fails the stage, and the run with it in the stage's words, unless the
   streaming sibling is still live (the run then ends with the sibling's settlement).
3. A half torn down because its sibling failed is cancelled, never a root cause: it restarts
   with the sibling (same due time, no restart of its own spent) when the sibling restarts,
   else its stage is cancelled and the run fails in the sibling's words.
4. A stop cancels the attempt, the stage, and the run unless the sibling is still live.
5. Otherwise every rank exited 0: the attempt and the stage succeeded.
"""

from __future__ import annotations

from dataclasses import dataclass

from eyas.state import specs

SUCCEEDED = "every rank exited 0"


@dataclass(frozen=True)
class Ending:
    """What the attempt's end was: its root cause in words (None: no failure), whether the stage
    called that failure final, the stop recorded for it (None: none), and when it ended."""

    failure: str | None
    final: bool
    cancel: str | None
    ended_at: float


@dataclass(frozen=True)
class StageRecord:
    """The stage's record and limits as the settlement finds them."""

    name: str
    restarts: int
    max_restarts: int
    backoff: float


@dataclass(frozen=True)
class Sibling:
    """The other half of a streaming pair: whether its group is still live, and its stage's
    state, reason and due restart as the store has them."""

    name: str
    live: bool
    state: str
    reason: str | None
    restart_at: float | None


@dataclass(frozen=True)
class Restart:
    number: int  # the stage's restart count once it is scheduled
    due: float
    spends: bool  # False: a sibling's restart, which spends none of this stage's


@dataclass(frozen=True)
class Verdict:
    """What to record: the attempt's end, then either a restart or the stage's end, and the
    run's end (None: the run goes on, or ends with the sibling's settlement)."""

    attempt: str
    attempt_reason: str
    restart: Restart | None = None
    restart_note: str | None = None  # what the stage's event says while it waits to restart
    stage: str | None = None
    stage_reason: str | None = None
    keeps_summary: bool = False  # the stage's summary is written with its end
    run: str | None = None
    run_reason: str | None = None


def decide(end: Ending, stage: StageRecord, stopping: bool, sibling: Sibling | None = None) -> Verdict:
    """The verdict for one attempt's end (the policy in this module's docstring)."""
    live_sibling = sibling is not None and sibling.live
    if end.failure is not None:
        why = end.failure
        if end.cancel is None and not end.final and stage.restarts < stage.max_restarts and not stopping:
            n = stage.restarts + 1
            due = end.ended_at + stage.backoff * (2 ** (n - 1))
            note = f"restart {n} of {stage.max_restarts} in {stage.backoff * (2 ** (n - 1)):.1f}s after {why}"
            return Verdict("failed", why, restart=Restart(n, due, spends=True), restart_note=note)
        return Verdict(
            "failed",
            why,
            stage="failed",
            stage_reason=why,
            keeps_summary=True,
            run=None if live_sibling else "failed",
            run_reason=None if live_sibling else f"{stage.name}: {why}",
        )
    if end.cancel is not None and end.cancel.startswith(specs.SIBLING_TEARDOWN):
        if sibling is None:
            raise ValueError(f"{stage.name}: torn down for a sibling it does not have")
        if sibling.state == "running" and sibling.restart_at is not None and not stopping:
            return Verdict(
                "cancelled",
                end.cancel,
                restart=Restart(stage.restarts, sibling.restart_at, spends=False),
                restart_note=f"restarts with {sibling.name}: {end.cancel}",
            )
        return Verdict(
            "cancelled",
            end.cancel,
            stage="cancelled",
            stage_reason=end.cancel,
            run="failed",
            run_reason=f"{sibling.name}: {sibling.reason}",
        )
    if end.cancel is not None:
        return Verdict(
            "cancelled",
            end.cancel,
            stage="cancelled",
            stage_reason=end.cancel,
            run=None if live_sibling else "cancelled",
            run_reason=None if live_sibling else f"{stage.name}: {end.cancel}",
        )
    return Verdict("succeeded", SUCCEEDED, stage="succeeded", stage_reason=SUCCEEDED, keeps_summary=True)
