"""One thread owns the daemon's database connection and runs every store transaction, in
the order they were asked for, so that the event loop never waits on SQLite.

Another process that holds the database locked (a backup tool, an `sqlite3` shell in a
transaction) then delays the record, never the daemon: it goes on serving, supervising and
tearing groups down. Each try waits at most `BUSY_TIMEOUT_S` for the lock; a transaction
that meets a held lock is tried again with a doubling delay until it commits (or, for one
that a client waits on, until its deadline), and while that lasts the writer is *busy*:
`eyas daemon status` says since when and what waits.

Written by hand rather than with a thread pool: a pool's queued work cannot be taken back
once its caller has given up, and a request that answered "store busy" must never be done
afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("eyas.daemon.storewriter")

# Long enough for the daemon's own checkpoints and a reader's brief lock; short enough that a
# transaction behind a held lock gives the thread back at once to say so.
BUSY_TIMEOUT_S = 0.1
FIRST_DELAY = 0.05
MAX_DELAY = 1.0


class StoreBusy(Exception):
    """The database stayed locked by another process past a request's deadline; nothing of
    the request was written."""


def is_busy(exc: BaseException) -> bool:
    """Whether `exc` says another connection holds the database locked (SQLITE_BUSY or
    SQLITE_LOCKED, extended codes included)."""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    text = str(exc)
    return "database is locked" in text or "database is busy" in text or "database table is locked" in text


@dataclass
class Busy:
    """The writer is waiting for a lock another process holds."""

    since: float
    what: str  # the transaction that waits: "recording the end of run 3 train attempt 1"
    tries: int = 0


@dataclass
class _Job:
    fn: Callable[[Any], Any]
    what: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    deadline: float | None  # give up (StoreBusy) once past it, still locked
    state: str = "queued"  # queued -> running -> done; or queued -> abandoned
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _leave_queue(self, to: str) -> bool:
        """Move a queued job to `to` ("running" or "abandoned"); False if it had left already."""
        with self.lock:
            if self.state != "queued":
                return False
            self.state = to
            return True

    def start(self) -> bool:
        return self._leave_queue("running")

    def abandon(self) -> bool:
        """Take the job back if it has not started: True when it never will."""
        return self._leave_queue("abandoned")


class Writer:
    """The daemon's one store thread. `submit` queues a transaction `fn(db)` and returns an
    asyncio future of its result; `call` waits for it, with an optional deadline."""

    def __init__(self, db, *, on_busy: Callable[[Busy | None], None] | None = None):
        self.db = db
        if db is not None:
            db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        self.busy: Busy | None = None
        # Told (on the event loop of the job that met or freed the lock) when the writer
        # becomes busy and when it is free again, so that subscribers can be told.
        self.on_busy = on_busy or (lambda busy: None)
        self._queue: deque[_Job] = deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- the event loop's side --------------------------------------------------------------

    def submit(self, fn: Callable[[Any], Any], what: str, *, deadline: float | None = None) -> asyncio.Future:
        """Queue `fn(db)`, run in one transaction; the future holds its result or exception
        (StoreBusy when `deadline`, a time.time(), passed while the database stayed locked)."""
        return self._submit(fn, what, deadline).future

    def _submit(self, fn, what: str, deadline: float | None) -> _Job:
        loop = asyncio.get_running_loop()
        job = _Job(fn, what, loop, loop.create_future(), deadline)
        with self._wake:
            if self._closed:
                raise RuntimeError("the store writer is closed")
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="eyas-store", daemon=True)
                self._thread.start()
            self._wake.notify()
        return job

    async def call(self, fn: Callable[[Any], Any], what: str, *, timeout: float | None = None) -> Any:
        """Run `fn(db)` and return its result. With `timeout`, raise StoreBusy when it has not
        committed by then; a transaction that had not started by then never will."""
        deadline = None if timeout is None else time.time() + timeout
        job = self._submit(fn, what, deadline)
        future = job.future
        if timeout is None:
            return await future
        done, _ = await asyncio.wait({future}, timeout=timeout)
        if not done and job.abandon():
            raise StoreBusy(self.busy_text(what))
        # Started before the deadline: it ends by the deadline plus one try (it checks it).
        return await future

    def pending(self) -> int:
        with self._wake:
            return len(self._queue)

    async def drain(self) -> None:
        """Wait until everything queued before now is done (and its callbacks have run)."""
        await self.call(lambda db: None, "draining the store queue")
        await asyncio.sleep(0)

    def status(self) -> dict | None:
        """What op_status reports: None, or since when the writer waits for a lock and on what."""
        busy = self.busy
        if busy is None:
            return None
        return {"since": busy.since, "what": busy.what, "tries": busy.tries, "pending": self.pending()}

    def close(self, timeout: float | None = None) -> bool:
        """Finish what is queued and end the thread; False if it was still working at `timeout`."""
        with self._wake:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def busy_text(self, what: str, then: str = "try again once the lock is released") -> str:
        """The refusal of `what` while another process holds the database locked; `then`, what
        to do about it."""
        busy = self.busy
        since = f" for {time.time() - busy.since:.1f} s" if busy else ""
        return f"store busy: another process holds the database locked{since}; {what} was not done ({then})"

    # -- the thread's side ----------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
            if job.start():
                self._run(job)

    def _run(self, job: _Job) -> None:
        delay = FIRST_DELAY
        while True:
            try:
                with self.db.atomic():
                    result = job.fn(self.db)
            except Exception as exc:  # noqa: BLE001 - handed to the job's future
                if is_busy(exc):
                    if job.deadline is not None and time.time() >= job.deadline:
                        self._deliver(job, error=StoreBusy(self.busy_text(job.what)))
                        return
                    self._note_busy(job, exc)
                    time.sleep(delay)
                    delay = min(delay * 2, MAX_DELAY)
                    continue
                self._deliver(job, error=exc)
                return
            self._note_free(job)
            self._deliver(job, result=result)
            return

    def _note_busy(self, job: _Job, exc: BaseException) -> None:
        if self.busy is None:
            self.busy = Busy(time.time(), job.what, 1)
            log.warning("store busy: %s while %s; the daemon goes on and tries again", exc, job.what)
            self._tell(job, self.busy)
        else:
            self.busy.what = job.what
            self.busy.tries += 1

    def _note_free(self, job: _Job) -> None:
        if self.busy is not None:
            log.warning(
                "store free again after %.1f s (%d tries); %s is recorded",
                time.time() - self.busy.since,
                self.busy.tries,
                job.what,
            )
            self.busy = None
            self._tell(job, None)

    def _tell(self, job: _Job, busy: Busy | None) -> None:
        try:
            job.loop.call_soon_threadsafe(self.on_busy, busy)
        except RuntimeError:  # the loop is closed: nobody left to tell
            pass

    @staticmethod
    def _deliver(job: _Job, *, result: Any = None, error: BaseException | None = None) -> None:
        with job.lock:
            job.state = "done"

        def settle() -> None:
            if job.future.done():
                return
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)

        try:
            job.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed (a test's asyncio.run ended)
            pass
