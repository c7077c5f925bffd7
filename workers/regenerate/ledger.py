"""The regenerated rows on disk until the dataset is assembled: `regenerate/rows/rank-<r>.jsonl`, one line per finished batch, and the identity those lines are bound to.

A rank appends each batch it finishes as one line (one write, then fsync), so a batch is either
wholly there or not at all: a rank killed mid-write leaves a torn last line, which every reader
ignores and the rank cuts off before it appends again (`open_own`), so its next line never
glues onto it. A retried or resumed rank reads every rank's file (`finished`), so batches done by
any earlier attempt, whatever its world size, are skipped and never duplicated; a batch that was
cut off is simply not there and runs again, whole, computing what it would have.

The folder is bound to one regeneration (`claim`): the target, the prepared dataset and the
sampling settings. Rows drawn otherwise are never mixed in: a mismatch stops the stage, naming
the setting and the fix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from eyas.workers.runtime import atomic

ROWS_DIR = "rows"
IDENTITY = "identity.json"


def rows_dir(out_dir: Path) -> Path:
    return out_dir / ROWS_DIR


def rank_file(out_dir: Path, rank: int) -> Path:
    return rows_dir(out_dir) / f"rank-{rank}.jsonl"


def claim(out_dir: Path, identity: dict) -> None:
    """Bind `out_dir`/rows to one regeneration: the first rank to come records `identity` (an
    exclusive link: one writer wins); every later rank and attempt must match it."""
    folder = rows_dir(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    differ = atomic.claim_json(folder / IDENTITY, identity)
    if differ is not None:
        key, there = differ
        raise RuntimeError(
            f"{folder} holds rows regenerated otherwise ({key}: {there!r} there, "
            f"{identity.get(key)!r} now): rows drawn two ways are never mixed; restore the setting, "
            f"or delete {folder} to regenerate every row"
        )


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(offset just past the line, the line) for each complete line of `path`."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    start = 0
    while True:
        end = data.find(b"\n", start)
        if end < 0:
            return
        yield end + 1, data[start:end]
        start = end + 1


def _batch(line: bytes, plan: list[list[int]]) -> dict | None:
    """A line as a batch record of `plan`, or None when it is not one (torn, or of another plan)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    b, rows = record.get("batch"), record.get("rows")
    if not isinstance(b, int) or not 0 <= b < len(plan) or not isinstance(rows, list):
        return None
    if [r.get("row") if isinstance(r, dict) else None for r in rows] != plan[b]:
        return None
    return record


def finished(out_dir: Path, plan: list[list[int]]) -> dict[int, dict]:
    """Every batch of `plan` some rank has written, by batch index (the first copy of each)."""
    done: dict[int, dict] = {}
    for path in sorted(rows_dir(out_dir).glob("rank-*.jsonl")):
        for _, line in _lines(path):
            record = _batch(line, plan)
            if record is not None:
                done.setdefault(record["batch"], record)
    return done


def open_own(out_dir: Path, rank: int) -> int:
    """Rank `rank`'s file, opened for appending after its last complete line (a torn tail, what a
    kill mid-write leaves, is cut off first). Returns the descriptor."""
    path = rank_file(out_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    keep = 0
    for offset, _ in _lines(path):
        keep = offset
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    if os.fstat(fd).st_size != keep:
        os.ftruncate(fd, keep)
        os.fsync(fd)
    return fd


def append(fd: int, batch: int, rows: list[dict]) -> int:
    """Write one finished batch as one line, durably; returns its bytes."""
    data = json.dumps({"batch": batch, "rows": rows}, separators=(",", ":")).encode() + b"\n"
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)
    return len(data)
