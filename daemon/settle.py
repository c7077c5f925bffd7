"""A group's settlement is written whole or not at all: its rank exits, its errors, the
attempt's, stage's and run's new states and the restart the policy calls for go into one
transaction, and the group leaves the daemon's memory only once that transaction committed.

Settling has two halves. `describe` runs once per group, on the event loop: it reads what
the ranks left (error files, log tails, the TP workers' last word) into error records, root
cause first, and notes when the group really ended. `record` decides and writes, as one job
on the store thread (daemon/storewriter.py); it may run many times, because a write can fail
(a full disk: the daemon keeps the group and retries, daemon/diskfull.py) or wait (another
process holds the database locked), and each time it decides afresh from the store, so that
a stop recorded meanwhile (daemon/intent.py) still counts. Its times are the group's own,
never the moment the write finally got through.

A streaming run's extract and train fail as one: the half torn down because the other failed
(daemon/agent.py) settles after it, as cancelled and never as a root cause, and restarts with
it when the failed half restarts (the verdict is daemon/verdict.py's).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from eyas.state import contract, specs, store
from eyas.state.contract import ErrorRecord

from . import diskfull, failures, intent, verdict, watchdog
from .failures import who
from .group import Group
from .ranks import RankExit, read_json

log = logging.getLogger("eyas.daemon.settle")


@dataclass
class Account:
    """What a group's end was, read once: error records (root cause first), and whose."""

    records: list[tuple[RankExit | None, ErrorRecord]]  # (whose, error record); None: the watchdog's
    exits: list[RankExit]  # every member's exit, recorded again with the settlement
    summary_json: str | None
    ended_at: float  # when the last member was seen to end
    exit_fields: list  # (exit, its ranks row), as the settlement writes them


def describe(core, group: Group) -> Account:
    """Read the group's end: error records, root cause first (the watchdog's stall record
    before the ranks' own failures; a straggler's record in time order)."""
    workers = group.settle_workers()
    records = failures.ordered(group, core.host, watchdog.record(group, core.host))
    # Ended from outside its ranks (Slurm's TIMEOUT, NODE_FAIL, ...): that is the root cause,
    # and the ranks' own failures, if any, come after it.
    outside = group.outside_end(core.host)
    if outside is not None:
        records.insert(0, (None, outside))
    # The stage's summary is its last finished attempt's, a failed one's included (evaluate
    # records its figures, then fails on a lossless mismatch: the figures stay beside the error).
    summary = read_json(group.dir / contract.SUMMARY)
    exits = [r.exit for r in group.ranks if r.exit is not None] + workers
    ended_at = max((ex.time for ex in exits if ex.time), default=time.time())
    return Account(
        records,
        exits,
        json.dumps(summary) if summary is not None else None,
        ended_at,
        [(ex, core._exit_fields(group, ex)) for ex in exits],
    )


def record(core, db, group: Group, account: Account, records: list[ErrorRecord]) -> None:
    """On the store thread, in the job's one transaction: the exits, the errors, the attempt's
    end, and the stage's and run's (or the restart the policy calls for, with its due time).
    The policy is daemon/verdict.py's; this gathers its facts and writes its verdict."""
    run_id, stage, end = group.run_id, group.stage, account.ended_at
    with core.transaction():
        for ex, fields in account.exit_fields:
            core._write_exit(db, group, ex, fields)
        for i, rec in enumerate(records):
            store.record_error(db, group.attempt_id, root_cause=(i == 0), **rec.fields())
        # A hang finding's stacks now live in its error's traceback; only recovery read them here.
        db.execute("UPDATE attempts SET stuck_json = NULL WHERE id = ?", [group.attempt_id])
        srow = store.stage_row(db, run_id, stage)
        # The user's stop, in memory or recorded by a daemon that died since (intent.py).
        cancel = group.cancel_reason or db["attempts"].get(group.attempt_id).get("cancel_reason")
        failure = None
        if records:
            rec = records[0]
            lead = "" if account.records[0][0] is None else f"{who(account.records[0][0])} failed: "
            failure = f"{lead}{rec.type}" + (f": {rec.message}" if rec.message else "")
        facts = verdict.StageRecord(
            stage, srow["restarts"], srow["max_restarts"] or 0, core._backoff(db, run_id, stage) if records else 0.0
        )
        ending = verdict.Ending(failure, bool(records) and records[0].final, cancel, end)
        found = verdict.decide(ending, facts, core.stopping, _sibling(core, db, group))
        _write(core, db, group, found, account.summary_json, end)


def _sibling(core, db, group: Group) -> verdict.Sibling | None:
    """The other half of a streaming pair as the verdict needs it; None for any other stage."""
    other = specs.sibling(group.stage)
    if other is None:
        return None
    try:
        row = store.stage_row(db, group.run_id, other)
    except store.NotFound:  # a pipeline with one half only: no sibling to wait for
        return None
    return verdict.Sibling(other, _sibling_live(core, group), row["state"], row["reason"], row["restart_at"])


def _write(core, db, group: Group, found: verdict.Verdict, summary_json: str | None, end: float) -> None:
    run_id, stage = group.run_id, group.stage
    store.move_attempt(db, group.attempt_id, found.attempt, found.attempt_reason, now=end)
    if found.restart is not None:
        # Due from the real end: a write that waited out a lock does not push it back.
        store.schedule_restart(db, run_id, stage, found.restart.number, found.restart.due)
        core._emit_state(run_id, "stage", "running", found.restart_note, stage=stage)
        return
    summary = {"summary_json": summary_json} if found.keeps_summary else {}
    core._move_stage(run_id, stage, found.stage, found.stage_reason, now=end, **summary)
    if found.run is not None:
        core._finish_run(db, run_id, found.run, found.run_reason, now=end)


def _sibling_live(core, group: Group) -> bool:
    """Whether the other half of a streaming pair is still a live group: the run ends only once
    neither is (a run that is over has no rank left)."""
    other = specs.sibling(group.stage)
    return other is not None and any(
        g is not group and g.run_id == group.run_id and g.stage == other for g in core.groups.values()
    )


def settle(core, group: Group, now: float) -> None:
    """Start recording the end of a group that has ended, unless that is under way or a retry
    is not due yet; `core._settled` lets the group go once the record is written."""
    if group.settling or now < group.settle_retry_at:
        return
    if group.account is None:
        try:
            # One last sample, so that the progress lines written just before exiting count;
            # queued before the settlement, so written before it.
            core.sample(now, [group], final=True)
        except Exception:  # the figures are not worth the settlement
            log.exception("final sample of run %s %s failed", group.run_id, group.stage)
        group.account = describe(core, group)
    # Decided now, on the loop: whether the disk was full is a question about this moment.
    records = [failures.as_recorded(core, group, ex, rec) for ex, rec in group.account.records]
    what = f"recording the end of run {group.run_id} {group.stage} attempt {group.attempt} in eyas.db"
    group.settling = True
    # Queued now: after the final sample and any stop already queued, before anything later.
    future = core.submit(lambda db: record(core, db, group, group.account, records), what)
    future.add_done_callback(lambda f: _written(core, group, f, what))


def _written(core, group: Group, future, what: str) -> None:
    group.settling = False
    if future.cancelled():
        return
    exc = future.exception()
    if exc is None:
        if group.cancel_reason is not None:  # its stop intent, if any, is in the record now
            intent.clear_stop(group.dir)
        core._settled(group)
        return
    now = time.time()
    if diskfull.is_full(exc):
        core.disk.mark(what, exc, now)
        group.settle_retry_at = core.disk.state.retry_at
    else:
        log.error("%s failed; trying again", what, exc_info=exc)
        group.settle_retries += 1
        group.settle_retry_at = now + min(diskfull.MAX_DELAY, diskfull.FIRST_DELAY * 2**group.settle_retries)
