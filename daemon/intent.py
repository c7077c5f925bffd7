"""Intent is durable before it acts: a stop is recorded on its attempt before any signal is
sent, and a restarted daemon reads every recorded intent back and finishes the same decision.

What is recorded where (state/schema.py, migration 4):
- a stop, or the daemon's own shutdown (Core._record_stop, before any signal):
  `attempts.cancel_reason` and `cancel_at`. A daemon
  restarted before the group ended finishes the teardown, counts no rank death after
  `cancel_at` as a failure, and settles the attempt `cancelled` with the reason: never a
  SIGTERM failure, never restarted;
- a restart after backoff: `stages.restart_at`, written with the failed attempt's settlement
  (daemon/settle.py); the scheduler starts the next attempt when it is due, whichever daemon
  is running then;
- the hang watchdog's finding (Stalled, Straggler; daemon/watchdog.py): `attempts.stuck_json`
  (migration 5), written before its teardown and again with the stacks it collected; a
  restarted daemon settles the attempt with that root cause, never as the SIGTERM deaths the
  teardown caused;
- skips, retries and resumes are state moves, each one transaction, committed before the
  request is answered; the scheduler acts only on what the store says.
"""

from __future__ import annotations

import json
import logging
import os
import time

import psutil

from eyas.state import contract

from . import watchdog
from .group import Group

log = logging.getLogger("eyas.daemon.intent")


def resume(core, group: Group, attempt: dict) -> None:
    """Re-adopting an attempt: take up a stop, or a hang finding, that the last daemon
    recorded, and finish it."""
    reason = attempt.get("cancel_reason")
    if reason is None:
        if attempt.get("stuck_json"):
            _resume_stuck(core, group, json.loads(attempt["stuck_json"]))
        return
    group.cancel_reason = reason
    # Deaths before the stop are the ranks' own failures; from then on, the stop's doing.
    group.teardown_since = attempt.get("cancel_at") or time.time()
    log.info(
        "run %s: %s attempt %d: finishing the stop recorded before the restart (%s)",
        group.run_id,
        group.stage,
        group.attempt,
        reason,
    )
    core._spawn_task(group.teardown(core.grace, reason))


def _resume_stuck(core, group: Group, stuck: dict) -> None:
    """The watchdog had found the attempt stuck (Stalled, Straggler): settle it so. With its
    stacks already recorded, finish the teardown, whose deaths are the finding's doing; without
    them, collect them first, as the watchdog would have."""
    group.stuck = stuck
    log.info(
        "run %s: %s attempt %d: finishing the %s finding recorded before the restart",
        group.run_id,
        group.stage,
        group.attempt,
        stuck["kind"],
    )
    if "asked" in stuck:
        group.teardown_since = stuck["time"]
        core._spawn_task(group.teardown(core.grace, stuck["kind"]))
    else:  # no "asked" yet: it counts as collecting
        core._spawn_task(watchdog.end(group, core.grace, core.record_stuck))


def find_monitor(group: Group, rank: int) -> tuple[int, float] | None:
    """The monitor of `rank`, found by the environment the daemon gave it, when its pid was
    never recorded: the daemon died between starting it and writing its row, and before the
    monitor wrote its proc file. Without this, a live rank would be settled as lost and its
    attempt started again beside it."""
    wanted = {contract.ATTEMPT_DIR: str(group.dir), contract.RANK: str(rank)}
    for p in psutil.process_iter(["environ"]):
        try:
            env = p.info["environ"] or {}
            if all(env.get(k) == v for k, v in wanted.items()) and os.getsid(p.pid) == p.pid:
                return p.pid, p.create_time()
        except (psutil.Error, OSError):
            continue
    return None
