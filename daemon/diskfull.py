"""A full state directory is a condition the daemon records and waits out, never a crash:
this module tells the errors that mean "no space left" and paces the retries until there is.

While the condition holds, the daemon keeps every group whose end it could not record in
memory, starts no attempt, and retries its writes with a doubling delay; the condition ends
when a probe file can be written in the state directory and enough space is free again.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("eyas.daemon.diskfull")

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# Below this much free space the state directory counts as full: a rank flooding its log
# fills the last megabyte in moments, and an attempt started there would fail at once.
MIN_FREE = 1 << 20
FIRST_DELAY = 0.5
MAX_DELAY = 5.0
_PROBE = ".space-probe"
_PROBE_BYTES = 64 * 1024


def is_full(exc: BaseException | None) -> bool:
    """Whether `exc` (or what caused it) says the disk or the quota is full."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return True
        if isinstance(exc, sqlite3.DatabaseError) and (
            getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(exc)
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def errno_name(exc: BaseException) -> str:
    """ "ENOSPC", "EDQUOT": the name a root cause gives the condition (SQLite says neither)."""
    if isinstance(exc, OSError) and exc.errno == errno.EDQUOT:
        return "EDQUOT"
    return "ENOSPC"


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on `path`'s file system; None if unknown."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


@dataclass
class Full:
    what: str  # "ENOSPC while writing eyas.db (metrics): database or disk is full"
    since: float
    retry_at: float
    delay: float = FIRST_DELAY


class Condition:
    """Whether the state directory `home` is full, what failed, and when to try again."""

    def __init__(self, home: Path):
        self.home = home
        self.state: Full | None = None
        self.seen_at: float | None = None  # the last moment the directory was known full
        # Told status() each time the condition starts or ends (the daemon publishes it, so
        # the TUI can say so while it lasts).
        self.on_change: Callable[[dict | None], None] = lambda status: None

    @property
    def full(self) -> bool:
        return self.state is not None

    def mark(self, what: str, exc: BaseException | None = None, now: float | None = None) -> None:
        """Note a failed write (`what` failed with `exc`); the first one names the condition."""
        now = now or time.time()
        self.seen_at = now
        text = f"{errno_name(exc) if exc else 'ENOSPC'} while {what}" + (f": {exc}" if exc else "")
        if self.state is None:
            self.state = Full(text, now, now + FIRST_DELAY)
            # The log may be on the full disk too; the status request still says it.
            log.warning("state directory full: %s; no attempt starts until space returns", text)
            self.on_change(self.status())
        elif self.due(now):
            # A retry failed: wait longer. Other writes failing meanwhile change nothing.
            self._later(now)

    def due(self, now: float) -> bool:
        """Whether a retry of the writes that failed is due (always, when not full)."""
        return self.state is None or now >= self.state.retry_at

    def low(self, path: Path | None = None) -> bool:
        free = free_bytes(path or self.home)
        return free is not None and free < MIN_FREE

    def check(self, now: float) -> None:
        """The 1 Hz look at the state directory: full when space runs out, and, when a retry
        is due, clear again once a probe file can be written."""
        if self.state is None:
            if self.low():
                self.mark(f"checking free space in {self.home}: less than {MIN_FREE >> 20} MiB free", None, now)
            return
        self.seen_at = now
        if not self.due(now):
            return
        if self.low() or not self._probe():
            self._later(now)
            return
        log.warning("state directory has space again after %.1f s (%s)", now - self.state.since, self.state.what)
        self.state = None
        self.on_change(None)

    def _later(self, now: float) -> None:
        self.state.delay = min(self.state.delay * 2, MAX_DELAY)
        self.state.retry_at = now + self.state.delay

    def _probe(self) -> bool:
        path = self.home / _PROBE
        try:
            with open(path, "wb") as f:
                f.write(b"\0" * _PROBE_BYTES)
                f.flush()
                os.fsync(f.fileno())
            return True
        except OSError:
            return False
        finally:
            try:
                path.unlink()
            except OSError:
                pass

    def status(self) -> dict | None:
        """What op_status reports: None, or what failed first and since when."""
        if self.state is None:
            return None
        return {"what": self.state.what, "since": self.state.since, "retry_at": self.state.retry_at}
