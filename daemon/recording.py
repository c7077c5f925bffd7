"""The daemon's way to the store: every read and write of eyas.db is a job on the store thread (daemon/storewriter.py), and the state events a job emits go out only once it committed.

The loop waits for a job only where the answer decides what it does next (a request's reply,
the start of an attempt, which must be recorded before its ranks are spawned); the rest (rank
exits, pids, metrics) is queued and written in order, so a database locked by another process
delays the record and never the supervision.
"""

from __future__ import annotations

import asyncio
import logging
import time

from eyas.state import store

from . import diskfull

log = logging.getLogger("eyas.daemon.recording")


class Recording:
    """Store access and state events for the daemon's Core (daemon/core.py holds the state it uses)."""

    def _emit_state(self, run_id: int, entity: str, new: str, reason: str, stage=None, attempt=None) -> None:
        event = {
            "run_id": run_id,
            "stage": stage,
            "attempt": attempt,
            "entity": entity,
            "to_state": new,
            "reason": reason,
            "time": time.time(),
        }
        held = getattr(self._local, "held", None)
        if held is not None:  # inside a store job: announced once it has committed
            held.append(event)
        else:
            self.publish("state", event)

    def transaction(self):
        """A nested transaction inside a store job (a savepoint): the parts of a decision that
        must happen whole, or not at all, within the job's own transaction."""
        return self.db.atomic()

    def _job(self, fn):
        """`fn(db)` as a store job that also returns the state events it emitted, so that they
        go out to the subscribers only once it committed, never for a rolled-back change."""

        def run(db):
            self._local.held = []
            try:
                return fn(db), self._local.held
            finally:
                self._local.held = None

        return run

    def _announce(self, events: list[dict]) -> None:
        for event in events:
            self.publish("state", event)

    async def write(self, fn, what: str, *, timeout: float | None = None):
        """Run `fn(db)` as one transaction on the store thread and return its result; with
        `timeout`, StoreBusy when the database stayed locked that long (nothing was done)."""
        result, events = await self.store.call(self._job(fn), what, timeout=timeout)
        self._announce(events)
        return result

    def submit(self, fn, what: str) -> asyncio.Future:
        """Queue `fn(db)` now, in order with every write queued after it; the future holds its
        result (its state events announced) or its exception."""
        inner = self.store.submit(self._job(fn), what)
        outer = asyncio.get_running_loop().create_future()

        def finished(f: asyncio.Future) -> None:
            if f.cancelled():
                outer.cancel()
            elif f.exception() is not None:
                outer.set_exception(f.exception())
            else:
                result, events = f.result()
                self._announce(events)
                outer.set_result(result)

        inner.add_done_callback(finished)
        return outer

    def write_later(self, fn, what: str) -> asyncio.Future:
        """Queue `fn(db)` without waiting for it: a write that a later one repeats or that is
        worth less than going on (a pid, an exit that the settlement writes again, metrics).
        A full disk is noted on the condition; other errors are logged (eyas's own bugs)."""
        future = self.submit(fn, what)

        def finished(f: asyncio.Future) -> None:
            exc = None if f.cancelled() else f.exception()
            if exc is None:
                return
            if diskfull.is_full(exc):
                self.disk.mark(what, exc)
            else:
                log.error("%s failed", what, exc_info=exc)

        future.add_done_callback(finished)
        return future

    def _store_changed(self, busy) -> None:
        """A daemon-wide state event (no run): another process holds the database locked, or released it."""
        status = self.store.status()
        self.publish(
            "state",
            {
                "run_id": None,
                "stage": None,
                "attempt": None,
                "entity": "store",
                "to_state": "busy" if busy else "ok",
                "busy": status,
                "reason": (
                    f"store busy: waiting for a lock on eyas.db ({busy.what})" if busy else "the store is free again"
                ),
                "time": time.time(),
            },
        )
        if busy is None:
            self.poke()

    def _move_run(self, run_id: int, new: str, reason: str, **fields) -> None:
        store.move_run(self.db, run_id, new, reason, **fields)
        self._emit_state(run_id, "run", new, reason)

    def _move_stage(self, run_id: int, stage: str, new: str, reason: str, **fields) -> None:
        store.move_stage(self.db, run_id, stage, new, reason, **fields)
        self._emit_state(run_id, "stage", new, reason, stage=stage)

    def _disk_changed(self, full: dict | None) -> None:
        """A daemon-wide state event (no run): the state directory became full, or has space again."""
        self.publish(
            "state",
            {
                "run_id": None,
                "stage": None,
                "attempt": None,
                "entity": "daemon",
                "to_state": "full" if full else "ok",
                "full": full,
                "reason": full["what"] if full else "the state directory has space again",
                "time": time.time(),
            },
        )

    def record_started(self, group, ranks: list, what: str) -> None:
        """Queue the rows of ranks just started, with the group's rendezvous port: the group is
        supervised from their start, whether or not the rows can be written yet."""
        now, attempt_id, port, host = time.time(), group.attempt_id, group.master_port, self.host
        rows = [(r.rank, r.monitor_pid, r.monitor_create_time, r.device, str(r.log_path)) for r in ranks]

        def record(db):
            db["attempts"].update(attempt_id, {"master_port": port})
            for rank, mpid, mct, device, log_path in rows:
                store.upsert_rank(
                    db,
                    attempt_id,
                    rank,
                    monitor_pid=mpid,
                    monitor_create_time=mct,
                    host=host,
                    device=device,
                    state="running",
                    started_at=now,
                    log_path=log_path,
                )

        self.write_later(record, what)
