"""Intent is durable before it acts: a stop is written down before any signal is sent, and a
restarted daemon reads every recorded intent back and finishes the same decision.

What is recorded where (state/schema.py, migration 4):
- a stop, or the daemon's own shutdown (Agent._record_stop, before any signal): first the
  stop intent, `stop.json` in the attempt directory (state/contract.py: STOP_INTENT; the
  reason and the time; written to an owner-only 0600 temp file, fsynced, renamed into place,
  the directory fsynced), then the store record, `attempts.cancel_reason` and `cancel_at`,
  queued on the store thread. The signal follows the file at once: a stop never waits for
  eyas.db, which another process may hold locked for as long as it likes (a backup, an
  `sqlite3` shell), so `eyas stop` signals the live ranks whatever holds the store and says
  whether the record is in yet (daemon/api.py, op_stop). The store record repeats the file's
  time; once it commits, the file is removed (the settlement removes it too, for a record that
  failed). Only if the file cannot be written (a full disk) does the stop wait for the store
  record, INTENT_WAIT at most (daemon/agent.py), and then signal anyway.
  A daemon restarted before the group ended takes the stop from the store, else from the file
  (`stop_of`), writes the store record the last daemon could not, finishes the teardown,
  counts no rank death after the stop's time as a failure, and settles the attempt
  `cancelled` with the reason: never a SIGTERM failure, never restarted, never started again
  if the last daemon died while starting it (daemon/recovery.py). The file of an attempt that
  has settled is never read again: only running attempts are re-adopted;
- a restart after backoff: `stages.restart_at`, written with the failed attempt's settlement
  (daemon/settle.py); the scheduler starts the next attempt when it is due, whichever daemon
  is running then;
- the hang watchdog's finding (Stalled, Straggler; daemon/watchdog.py): `attempts.stuck_json`
  (migration 5), written before its teardown and again with the stacks it collected; a
  restarted daemon settles the attempt with that root cause, never as the SIGTERM deaths the
  teardown caused;
- skips, retries and resumes are state moves, each one transaction, committed before the
  request is answered; the scheduler acts only on what the store says. So is the stop of a run
  with nothing live: there is no rank to signal, only the record to change, and under a held
  lock it is refused after a while with nothing done, as any request is.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import psutil

from eyas.state import contract

from . import watchdog
from .group import Group

log = logging.getLogger("eyas.daemon.intent")


def write_stop(attempt_dir: Path, reason: str, at: float) -> bool:
    """Write the stop intent durably in `attempt_dir`, owner-only; False (logged) when it could
    not be written, so that the caller waits for the store record instead."""
    target = attempt_dir / contract.STOP_INTENT
    try:
        fd, tmp = tempfile.mkstemp(dir=attempt_dir, prefix=f".{contract.STOP_INTENT}.")  # 0600
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"reason": reason, "time": at}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(attempt_dir)  # the rename itself must survive a crash
    except OSError as exc:
        log.warning("could not write %s (%s); the stop waits for eyas.db instead", target, exc)
        return False
    return True


def read_stop(attempt_dir: Path) -> tuple[str, float] | None:
    """The stop intent in `attempt_dir` (its reason and time), if one was written."""
    path = attempt_dir / contract.STOP_INTENT
    try:
        found = json.loads(path.read_text())
        return str(found["reason"]), float(found["time"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        # Written whole or not at all (renamed into place): this is someone else's edit.
        log.warning("ignoring %s: not a stop intent eyas wrote (%s)", path, exc)
        return None


def clear_stop(attempt_dir: Path) -> None:
    """The stop is in the store (or the attempt settled): its intent file has done its job."""
    try:
        (attempt_dir / contract.STOP_INTENT).unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:  # harmless where it stays: only a running attempt's file is read
        log.warning("could not remove %s: %s", attempt_dir / contract.STOP_INTENT, exc)


def stop_of(attempt: dict) -> tuple[str, float | None, bool] | None:
    """The stop recorded for a running attempt (a row of `attempts`): its reason, its time and
    whether it is only in the intent file (the store never got it); None when there is none."""
    if attempt.get("cancel_reason") is not None:
        return attempt["cancel_reason"], attempt.get("cancel_at"), False
    found = read_stop(Path(attempt["dir"]))
    return None if found is None else (*found, True)


def resume(core, group: Group, attempt: dict) -> None:
    """Re-adopting an attempt: take up a stop, or a hang finding, that the last daemon
    recorded, and finish it."""
    stop = stop_of(attempt)
    if stop is None:
        if attempt.get("stuck_json"):
            _resume_stuck(core, group, json.loads(attempt["stuck_json"]))
        return
    reason, at, file_only = stop
    group.cancel_reason = reason
    # Deaths before the stop are the ranks' own failures; from then on, the stop's doing.
    group.teardown_since = at or time.time()
    if file_only:  # signalled while the store was held: the record the last daemon could not write
        core._record_stop(group, reason, group.teardown_since)
    log.info(
        "run %s: %s attempt %d: finishing the stop recorded before the restart (%s%s)",
        group.run_id,
        group.stage,
        group.attempt,
        reason,
        f"; read from {contract.STOP_INTENT}" if file_only else "",
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


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError:  # not every filesystem lets a directory be fsynced
        pass
    finally:
        os.close(fd)
