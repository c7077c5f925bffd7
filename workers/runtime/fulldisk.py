"""A rank's failure on a full disk reaches the daemon whole: the file that could not be written is named, and the exception's own traceback is recorded even though nothing new can be written.

Three pieces, used by the rank runtime (rank.py) and the monitor (monitor.py):
- `Reserve`: the blocks of a small record file (the rank's error file, the monitor's exit
  file), taken when the process starts and written into in place when it ends, so that writing
  the record then needs no new blocks;
- `name_log_streams`: a write to stdout or stderr that fails names the rank's log, which is
  what stdout and stderr are (an OSError from a file descriptor names no file of its own);
- `disk_full`: what the error record says of a full disk: which errno and which file.

Why a reserve rather than a recognisable block in the log: the log is where a full disk is
most often noticed first (a rank flooding it is what filled the disk), and a block written
there at the end needs exactly the new blocks that are gone. The reserve holds them from the
start. Stdlib only: the monitor imports it and must start fast.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
from pathlib import Path

from eyas.workers.runtime import atomic

FULL_ERRNOS = {errno.ENOSPC: "ENOSPC", errno.EDQUOT: "EDQUOT"}
# What a library that wraps the OS's error in its own (safetensors' Rust core, torch's
# serialisation) still says of it.
_FULL_TEXT = {"No space left on device": "ENOSPC", "Disk quota exceeded": "EDQUOT", "StorageFull": "ENOSPC"}
# An error record with a traceback is a few KiB; a chained one from deep in an engine, tens.
RESERVE_BYTES = 64 * 1024


class Reserve:
    """The blocks of the record file `path`, held in a hidden file beside it from `hold()` on.

    `write(data)` writes into those blocks (pwrite over allocated blocks takes none from the
    file system: tmpfs keeps the pages, ext4 keeps clusters back for converting its
    preallocated extents), cuts the file to `data`'s length and renames it to `path`, so a
    reader sees no file or the whole record, as with atomic.write_bytes. A copy-on-write file
    system (btrfs, ZFS) needs new blocks for any write: there the reserve only helps as long as
    some space is left. Without a held reserve `write` is an ordinary atomic write.
    """

    def __init__(self, path: str | os.PathLike[str], size: int = RESERVE_BYTES):
        self.path = Path(path)
        self.spare = self.path.with_name(f".{self.path.name}.reserve")  # dot: no rank-*.json glob sees it
        self.size = size

    @property
    def held(self) -> bool:
        return self.spare.exists()

    def hold(self) -> bool:
        """Take the blocks now; False (and nothing left behind) when they cannot be had."""
        try:
            fd = os.open(self.spare, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.size)  # glibc writes zeros where fallocate is missing
            finally:
                os.close(fd)
            return True
        except OSError:
            self.release()
            return False

    def write(self, data: bytes) -> None:
        """Write `data` as `path`, through the held blocks when there are; raises OSError when
        it cannot (a record larger than the reserve on a full disk: the caller may cut it)."""
        if not self.held:
            atomic.write_bytes(self.path, data)
            return
        fd = os.open(self.spare, os.O_WRONLY)
        try:
            view, done = memoryview(data), 0
            while done < len(data):
                done += os.pwrite(fd, view[done:], done)
            os.ftruncate(fd, len(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(self.spare, self.path)
        atomic._fsync_dir(self.path.parent)

    def release(self) -> None:
        """Give the blocks back (the process ended without needing them)."""
        with contextlib.suppress(OSError):
            os.unlink(self.spare)


class _NamedLog(io.FileIO):
    """stdout's or stderr's descriptor, whose failed writes name the file it is (the rank's log)."""

    log_path = ""

    def write(self, b):
        try:
            return super().write(b)
        except OSError as exc:
            if exc.filename is None:
                exc.filename = self.log_path
            raise


def name_log_streams(log_path: Path) -> None:
    """Make sys.stdout and sys.stderr name `log_path` when a write to them fails, where they are
    that file (the monitor's rank log; a rank run by hand to a terminal is left alone).

    Each stream is rebuilt as it was (buffered or not, its encoding, line buffering, write
    through) on a FileIO of the same descriptor whose write adds the name: one Python call per
    write that reaches the descriptor, nothing per character."""
    try:
        log = os.stat(log_path)
    except OSError:
        return
    for name in ("stdout", "stderr"):
        old = getattr(sys, name)
        try:
            fd = old.fileno()
            st = os.fstat(fd)
        except (AttributeError, OSError, ValueError):
            continue
        if (st.st_dev, st.st_ino) != (log.st_dev, log.st_ino) or not isinstance(old, io.TextIOWrapper):
            continue
        old.flush()
        raw = _NamedLog(fd, "w", closefd=False)
        raw.log_path = str(log_path)
        binary = raw if isinstance(old.buffer, io.FileIO) else io.BufferedWriter(raw)
        setattr(
            sys,
            name,
            io.TextIOWrapper(
                binary,
                encoding=old.encoding,
                errors=old.errors,
                line_buffering=old.line_buffering,
                write_through=old.write_through,
            ),
        )


def disk_full(exc: BaseException | None) -> dict | None:
    """{"errno": "ENOSPC" or "EDQUOT", "file": the path it failed to write, or None where no
    exception in the chain names one} when `exc` or what caused it says the disk (or the quota)
    is full; else None."""
    seen: set[int] = set()
    found = None
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            name = exc.filename
            if name is not None:
                name = os.fsdecode(name) if isinstance(name, (str, bytes)) else str(name)
            return {"errno": FULL_ERRNOS[exc.errno], "file": name}
        if found is None:
            text = str(exc)
            found = next(({"errno": e, "file": None} for t, e in _FULL_TEXT.items() if t in text), None)
        exc = exc.__cause__ or exc.__context__
    return found
