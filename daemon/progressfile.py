"""Tail a rank's `rank-<r>.progress.jsonl`: the records appended since a byte offset.

Hand-written rather than a library: it is a dozen lines of stdlib, and the only subtle
rules are the ones below (whole lines only, bad lines counted, truncation restarts).
"""

from __future__ import annotations

import json
import os

# A first read of a long run's file (say, after a daemon restart) is split over several
# 1 Hz samples, so no single sample stalls on megabytes of JSON.
MAX_BYTES = 4 << 20


def read_new(path: str | os.PathLike[str], offset: int, max_bytes: int = MAX_BYTES
             ) -> tuple[list[dict], int, int]:
    """Records (JSON objects) from complete lines after `offset`: (records, new_offset, bad).

    A half-written last line stays for the next call. A line that is not a JSON object is
    skipped and counted in `bad`. A missing file gives ([], offset, 0); a file shorter than
    `offset` was truncated or replaced, so reading restarts from 0.
    """
    records: list[dict] = []
    bad = 0
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return records, offset, 0
    with f:
        if os.fstat(f.fileno()).st_size < offset:
            offset = 0
        f.seek(offset)
        start = offset
        for line in f:
            if not line.endswith(b"\n"):
                if len(line) >= max_bytes:
                    # No writer makes such a line: skip it as bad rather than stall on it.
                    offset += len(line)
                    bad += 1
                break  # otherwise it is still being written
            offset += len(line)
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:  # includes UnicodeDecodeError
                    record = None
                if isinstance(record, dict):
                    records.append(record)
                else:
                    bad += 1
            if offset - start >= max_bytes:
                break
    return records, offset, bad

