"""A group's settlement is written whole or not at all: its rank exits, its errors, the
attempt's, stage's and run's new states and the restart the policy calls for go into one
transaction, and the group leaves the daemon's memory only once that transaction committed.

Settling has two halves. `describe` runs once per group: it reads what the ranks left (error
files, log tails, the TP workers' last word) into error records, root cause first. `record`
decides and writes; it may run many times, because a write can fail (a full disk: the daemon
keeps the group and retries, daemon/diskfull.py), and each time it decides afresh from the
store, so that a stop recorded meanwhile (daemon/intent.py) still counts.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from eyas.state import store

from . import diskfull, watchdog
from .supervisor import Group, RankExit, _read_json, describe_failure, log_tail

log = logging.getLogger("eyas.daemon.settle")


def who(ex: RankExit) -> str:
    return f"TP rank {ex.tp_rank}" if ex.tp_rank is not None else f"rank {ex.rank}"


@dataclass
class Account:
    """What a group's end was, read once: error records (root cause first), and whose."""

    records: list[tuple[RankExit | None, dict]]     # (whose, error record); None: the watchdog's
    exits: list[RankExit]           # every member's exit, recorded again with the settlement
    summary_json: str | None


def describe(core, group: Group) -> Account:
    """Read the group's end: error records, root cause first (the watchdog's stall record
    before the ranks' own failures; a straggler's record in time order)."""
    workers = group.settle_workers()
    failures = group.failures()
    records = [(ex, describe_failure(group, ex, core.host)) for ex in failures]
    stuck = watchdog.record(group, core.host)
    if stuck is not None and group.stuck["kind"] == "stall":
        # The ranks' own failures, if any, came after the daemon gave up on them.
        records.insert(0, (None, stuck))
    elif stuck is not None:
        # A straggler's own exception, raised before it hung on its way out, stays the cause.
        records = sorted([*records, (None, stuck)], key=lambda pair: pair[1]["time_"])
    # The stage's summary is its last finished attempt's, a failed one's included (evaluate
    # records its figures, then fails on a lossless mismatch: the figures stay beside the error).
    summary = _read_json(group.dir / "summary.json")
    exits = [r.exit for r in group.ranks if r.exit is not None]
    return Account(records, exits + workers,
                   json.dumps(summary) if summary is not None else None)


def _as_recorded(core, group: Group, ex: RankExit | None, rec: dict) -> dict:
    """One failure's error record as it is written; a rank whose exit or error file is missing
    because the state directory was full is named for that, not as a plain exit code or a lost
    rank. Decided at each try: the settlement's own write may be what shows the disk full."""
    if ex is None or ex.tp_rank is not None or ex.error is not None or ex.signal is not None or not _was_full(core, group):
        return rec
    missing = [name for name in (f"rank-{ex.rank}.exit.json", f"rank-{ex.rank}.error.json")
               if not (group.dir / name).exists()]
    if not missing:
        return rec
    how = f"exited with code {ex.exit_code}" if ex.exit_code is not None else "ended"
    return {**rec, "type": "ENOSPC", "source": "disk_full", "path": str(group.dir / missing[0]),
            "message": f"ENOSPC while writing {' and '.join(missing)}: the state directory {core.home} was full "
                       f"(no space left on device); rank {ex.rank} (pid {ex.pid}) {how}",
            "traceback": rec["traceback"] or log_tail(group.rank_of(ex.rank).log_path)}


def _was_full(core, group: Group) -> bool:
    disk = core.disk
    return (disk.full or (disk.seen_at is not None and disk.seen_at >= group.started_at - 1.0)
            or disk.low(group.dir))


def record(core, group: Group, account: Account) -> None:
    """Write the settlement in one transaction: the exits, the errors, the attempt's end, and
    the stage's and run's (or the restart the policy calls for, with its due time)."""
    db, run_id, stage = core.db, group.run_id, group.stage
    records = [_as_recorded(core, group, ex, rec) for ex, rec in account.records]
    with core.transaction():
        for ex in account.exits:
            core._record_exit(group, ex)
        for i, rec in enumerate(records):
            store.record_error(db, group.attempt_id, root_cause=(i == 0), **rec)
        srow = store.stage_row(db, run_id, stage)
        # The user's stop, in memory or recorded by a daemon that died since (intent.py).
        cancel = group.cancel_reason or db["attempts"].get(group.attempt_id).get("cancel_reason")
        if records:
            rec = records[0]
            lead = "" if account.records[0][0] is None else f"{who(account.records[0][0])} failed: "
            why = f"{lead}{rec['type']}" + (f": {rec['message']}" if rec["message"] else "")
            store.move_attempt(db, group.attempt_id, "failed", why)
            if cancel is None and srow["restarts"] < (srow["max_restarts"] or 0) and not core.stopping:
                n = srow["restarts"] + 1
                backoff = core._backoff(run_id, stage) * (2 ** (n - 1))
                store.schedule_restart(db, run_id, stage, n, time.time() + backoff)
                core._emit_state(run_id, "stage", "running",
                                 f"restart {n} of {srow['max_restarts']} in {backoff:.1f}s after {why}", stage=stage)
                return
            core._move_stage(run_id, stage, "failed", why, summary_json=account.summary_json)
            core._finish_run(run_id, "failed", f"{stage}: {why}")
        elif cancel is not None:
            store.move_attempt(db, group.attempt_id, "cancelled", cancel)
            core._move_stage(run_id, stage, "cancelled", cancel)
            core._finish_run(run_id, "cancelled", f"{stage}: {cancel}")
        else:
            store.move_attempt(db, group.attempt_id, "succeeded", "every rank exited 0")
            core._move_stage(run_id, stage, "succeeded", "every rank exited 0", summary_json=account.summary_json)


def settle(core, group: Group, now: float) -> bool:
    """Settle a group that has ended: True once its record is written (it may leave memory),
    False when the write failed and is to be tried again (the failure is noted on `core.disk`
    when the disk is full, else logged)."""
    if now < group.settle_retry_at:
        return False
    if group.account is None:
        try:
            # One last sample, so that the progress lines written just before exiting count.
            core.sample(now, [group], final=True)
        except Exception as exc:  # noqa: BLE001 - the figures are not worth the settlement
            if not diskfull.is_full(exc):
                log.exception("final sample of run %s %s failed", group.run_id, group.stage)
        group.account = describe(core, group)
    try:
        record(core, group, group.account)
    except Exception as exc:  # noqa: BLE001 - kept, and tried again: the group's end must be recorded
        what = f"recording the end of run {group.run_id} {group.stage} attempt {group.attempt} in eyas.db"
        if diskfull.is_full(exc):
            core.disk.mark(what, exc, now)
            group.settle_retry_at = core.disk.state.retry_at
        else:
            log.exception("%s failed; trying again", what)
            group.settle_retries += 1
            group.settle_retry_at = now + min(diskfull.MAX_DELAY, diskfull.FIRST_DELAY * 2 ** group.settle_retries)
        return False
    return True
