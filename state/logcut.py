"""Bounds a log that other processes append to, and reads one that may have been cut.

Writer side (`Bound`): once a log passes its bound, the middle goes. The file is truncated
back to its head (the first HEAD_SHARE of the bound, ended at a line break: start-up,
config, the first errors) and one marker line is put right after it, saying how many bytes
were cut and which setting cut them. Every writer of a rank log opened it O_APPEND (the
daemon opens it so, and the runtime and vLLM's workers inherit that descriptor), so each
later write lands at the new end, after the marker: no writer needs to know, reopen or
wait. The head never changes, so every cut of a file happens at the same place, and
`<stem>.cut.json` beside the log records the bound and, from the first cut on (written
before the truncation), the head's length, so that readers can find the marker.

Reader side (`Tail`): complete lines after an offset. It notices a cut (the file is now
shorter than the offset, or the bytes just before the offset are no longer those it read)
and goes on from the marker; a replaced file (another inode) is read from its start.

stdlib only: the rank monitor imports this and must start fast.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import contract

HEAD_SHARE = 0.10  # of the bound kept at the file's start, for good
MIB = 1 << 20
CHUNK = 8 << 20  # bytes a Tail reads at most per call, so a flood never stalls a reader
CHECK = 64  # bytes before the offset a reader remembers to recognise its place


def sidecar(log: Path | str) -> Path:
    """Where a log's cut is recorded: rank-0.log -> rank-0.cut.json."""
    log = Path(log)
    return log.with_name(f"{log.stem}.{contract.CUT}")


def read_cut(log: Path | str) -> dict:
    try:
        got = json.loads(sidecar(log).read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


class Bound:
    """Keeps one log under `max_bytes` (0: unbounded) by cutting its middle; `check()` now and then.

    `setting` names what set the bound, for the marker ("stages.train.log_max_mb = 512").
    Cutting needs a descriptor without O_APPEND (an O_APPEND pwrite would land at the end),
    so the log is opened here by path.
    """

    def __init__(self, path: Path | str, max_bytes: int, setting: str):
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self.setting = setting
        self.fd: int | None = None
        state = read_cut(self.path)  # a restarted owner (the daemon's splitter) goes on counting
        self.head: int | None = state.get("head")
        self.cuts = int(state.get("cuts", 0))
        self.dropped = int(state.get("dropped", 0))

    def check(self, coming: int = 0) -> int:
        """Cut the log if it passed the bound, or would with `coming` more bytes (a writer
        that cuts before it appends keeps its newest lines); returns the bytes cut (0: none)."""
        if self.max_bytes <= 0:
            return 0
        try:
            if self.fd is None:
                self.fd = os.open(self.path, os.O_RDWR)
            size = os.fstat(self.fd).st_size
            if size + coming <= self.max_bytes or size <= self.head_bytes():
                return 0
            return self._cut(size)
        except OSError:
            return 0  # a full disk or a vanished file: the next check tries again

    def head_bytes(self) -> int:
        return max(1, int(self.max_bytes * HEAD_SHARE))

    def _cut(self, size: int) -> int:
        if self.head is None:
            data = os.pread(self.fd, self.head_bytes(), 0)
            # End the head at a line break; a head that is one long line is cut mid-line.
            self.head = data.rfind(b"\n") + 1 or len(data)
        dropped = size - self.head
        self.cuts += 1
        self.dropped += dropped
        self.record()
        lead = b"" if self.head == 0 or os.pread(self.fd, 1, self.head - 1) == b"\n" else b"\n"
        marker = (
            lead
            + (
                f"eyas: ··· cut {dropped:,} bytes here ({self.path.name} passed {self.setting}; "
                f"cut {self.cuts} time{'s' if self.cuts != 1 else ''}, {self.dropped:,} bytes in all; "
                f"its first {self.head:,} bytes stay above) ···\n"
            ).encode()
        )
        # The marker is written over bytes being dropped anyway, then the file is cut right
        # after it: appends that came in between are part of the dropped middle, and every
        # later append lands after the marker. A reader never sees a half-written marker.
        os.pwrite(self.fd, marker, self.head)
        os.ftruncate(self.fd, self.head + len(marker))
        return dropped

    def record(self) -> None:
        """Write the sidecar: the bound, and where and how often the log was cut. The rank
        monitor writes it at start too, which tells the daemon's log splitter the bound."""
        path = sidecar(self.path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(
            json.dumps(
                {
                    "head": self.head,
                    "cuts": self.cuts,
                    "dropped": self.dropped,
                    "max_bytes": self.max_bytes,
                    "setting": self.setting,
                }
            )
        )
        os.replace(tmp, path)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def remember(before: bytes, data: bytes) -> bytes:
    """The last CHECK bytes read, once `data` has been read after `before`."""
    return data[-CHECK:] if len(data) >= CHECK else (before + data)[-CHECK:]


def still_there(fd: int, offset: int, before: bytes) -> bool:
    """Whether the bytes just before `offset` are still `before`: if not, the file was cut (and
    may have grown back past `offset`, so its size alone does not tell). One small pread."""
    return not before or os.pread(fd, len(before), offset - len(before)) == before


class Tail:
    """Complete lines of a log after an offset (None: its end when first read), read in
    slices of at most CHUNK bytes; notices cuts (`cuts` counts them) and replacement."""

    def __init__(self, path: Path | str, offset: int | None = 0):
        self.path = Path(path)
        self.offset = offset
        self.cuts = 0
        self.restarts = 0  # cuts and replacements: what was read before is not the file any more
        self._fd: int | None = None
        self._ino: tuple[int, int] | None = None
        self._before: bytes | None = None  # the bytes just before `offset`, as last read

    def _open(self) -> os.stat_result | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        ino = (st.st_dev, st.st_ino)
        if self._fd is not None and ino == self._ino:
            return st
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        replaced = self._fd is not None
        self.close()
        self._fd, self._ino = fd, ino
        if replaced:  # another file under the name: all of it is new
            self.offset, self._before = 0, b""
            self.restarts += 1
        return st

    def _moved(self, size: int) -> bool:
        """True when the bytes at our place are not the ones we read: the log was cut."""
        if self.offset > size:
            return True
        if self._before is None:  # first look at an offset given from outside: trust it
            self._before = os.pread(self._fd, min(CHECK, self.offset), self.offset - min(CHECK, self.offset))
            return False
        return not still_there(self._fd, self.offset, self._before)

    def _find_place(self) -> int | None:
        """Open (or reopen) the file and put `offset` where reading goes on: its size, or None
        when the file cannot be read."""
        st = self._open()
        if st is None:
            return None
        size = st.st_size
        if self.offset is None:
            self.offset = size
        if self._moved(size):
            self.cuts += 1
            self.restarts += 1
            head = read_cut(self.path).get("head")
            self.offset = head if isinstance(head, int) and 0 <= head <= size else 0
            self._before = os.pread(self._fd, min(CHECK, self.offset), self.offset - min(CHECK, self.offset))
        return size

    def read(self, final: bool = False, limit: int = CHUNK) -> bytes:
        """The next complete lines (at most `limit` bytes; a longer line comes in pieces); b""
        when there are none yet. With `final`, a last line without its newline too. After a
        cut the text starts at the marker line."""
        size = self._find_place()
        if size is None or size <= self.offset:
            return b""
        data = os.pread(self._fd, min(size - self.offset, limit), self.offset)
        end = len(data) if final and self.offset + len(data) >= size else data.rfind(b"\n") + 1
        if end == 0:
            if len(data) < limit:
                return b""  # a line still being written: wait for its end
            end = len(data)  # one enormous line: pass it on in pieces
        data = data[:end]
        self.offset += end
        self._before = remember(self._before, data)
        return data

    def lines(self, max_bytes: int = CHUNK) -> tuple[list[bytes], int]:
        """The next whole lines, each complete however long, until `max_bytes` have been read:
        (lines, skipped). A last line without its newline waits for the next call, unless it is
        already `max_bytes` long: no writer of a record makes such a line, so it is skipped
        and counted rather than waited on for ever."""
        size = self._find_place()
        if size is None or size <= self.offset:
            return [], 0
        found: list[bytes] = []
        skipped, start = 0, self.offset
        with os.fdopen(os.dup(self._fd), "rb") as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith(b"\n"):
                    if len(line) >= max_bytes:
                        self.offset += len(line)
                        skipped += 1
                    break
                self.offset += len(line)
                found.append(line)
                if self.offset - start >= max_bytes:
                    break
        if self.offset != start:
            self._before = os.pread(self._fd, min(CHECK, self.offset), self.offset - min(CHECK, self.offset))
        return found, skipped

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
