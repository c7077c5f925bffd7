"""Read a rank's `rank-<r>.progress.jsonl` as it grows: the JSON records of the complete lines after the last read, through state/logcut.Tail (so a truncated or replaced file is noticed).

Bad lines (not a JSON object) are skipped and counted; a half-written last line waits for
the next read.
"""

from __future__ import annotations

import json
import os

from eyas.state.logcut import Tail

# A first read of a long run's file (say, after a daemon restart) is split over several
# 1 Hz samples, so no single sample stalls on megabytes of JSON.
MAX_BYTES = 4 << 20


def _records(lines: list[bytes]) -> tuple[list[dict], int]:
    records: list[dict] = []
    bad = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # includes UnicodeDecodeError
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            bad += 1
    return records, bad


class ProgressReader:
    """One progress file, read on from where the last read stopped; `restarts` counts the
    times it was truncated or replaced (what was read before is void then)."""

    def __init__(self, path: str | os.PathLike[str], offset: int = 0, max_bytes: int = MAX_BYTES):
        self.tail = Tail(path, offset)
        self.max_bytes = max_bytes

    @property
    def offset(self) -> int:
        return self.tail.offset or 0

    @property
    def restarts(self) -> int:
        return self.tail.restarts

    def read(self) -> tuple[list[dict], int]:
        """(records, bad lines) since the last read."""
        lines, skipped = self.tail.lines(self.max_bytes)
        records, bad = _records(lines)
        return records, bad + skipped

    def close(self) -> None:
        self.tail.close()


def read_new(path: str | os.PathLike[str], offset: int, max_bytes: int = MAX_BYTES) -> tuple[list[dict], int, int]:
    """Records (JSON objects) from complete lines after `offset`, once: (records, new_offset, bad).

    A missing file gives ([], offset, 0); a file shorter than `offset` was truncated or
    replaced, so reading restarts from 0."""
    reader = ProgressReader(path, offset, max_bytes)
    try:
        records, bad = reader.read()
        return records, reader.offset, bad
    finally:
        reader.close()
