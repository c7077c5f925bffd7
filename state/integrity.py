"""A damaged database is reported as one line naming the file and the fix, never as a traceback.

Stdlib only: the read-only CLI (`eyas runs`, `show`, `errors`, `logs`) imports this when a
query fails, and must not pay for sqlite_utils. The daemon runs `check` when it opens the
store (store.open_writer), so a damaged page is found at start, not at the first write
that happens to touch it.
"""

from __future__ import annotations

import shlex
import sqlite3
from pathlib import Path

# SQLite's primary result codes for damage (extended codes keep them in the low byte):
# SQLITE_CORRUPT ("database disk image is malformed") and SQLITE_NOTADB ("file is not a
# database"). Matched by code, not by the wider DatabaseError class, whose subclass
# OperationalError also covers a busy or locked database, which is no damage.
SQLITE_CORRUPT = 11
SQLITE_NOTADB = 26
# quick_check stops after this many problems; the first one is shown, the rest are counted.
MAX_PROBLEMS = 10


class DatabaseDamaged(Exception):
    """The database file is damaged; str() is the one line to print."""

    def __init__(self, path: Path, detail: str):
        super().__init__(path, detail)
        self.path = Path(path)
        self.detail = detail

    def __str__(self) -> str:
        # Made when printed, after the daemon closed its connection: only then is it known
        # whether SQLite left a write-ahead log beside the database that must move with it.
        return message(self.path, self.detail)


def is_damage(exc: BaseException) -> bool:
    """Whether `exc` is SQLite saying the file is damaged or not a database at all."""
    code = getattr(exc, "sqlite_errorcode", None)
    return (
        isinstance(exc, sqlite3.DatabaseError) and code is not None and code & 0xFF in (SQLITE_CORRUPT, SQLITE_NOTADB)
    )


def message(path: Path, detail: str) -> str:
    """The line to print: the file, what SQLite found, and the two ways out."""
    path = Path(path).absolute()
    wal = path.with_name(path.name + "-wal")
    # A write-ahead log with content goes too: SQLite would replay it into the new database.
    # An empty one (a reader's) and the -shm index hold nothing and are rebuilt.
    moves = [path] + ([wal] if wal.exists() and wal.stat().st_size > 0 else [])
    mv = " && ".join(f"mv {shlex.quote(str(p))} {shlex.quote(str(p) + '.damaged')}" for p in moves)
    return (
        f"{path}: the eyas database is damaged ({detail}); restore a backup, or move it aside to start "
        f"a new history: {mv}"
    )


def check(conn: sqlite3.Connection, path: Path) -> None:
    """Run `PRAGMA quick_check` (every page and record, without matching indexes to their
    tables: linear in the file's size); raise DatabaseDamaged on any problem."""
    try:
        problems = [row[0] for row in conn.execute(f"PRAGMA quick_check({MAX_PROBLEMS})").fetchall()]
    except sqlite3.DatabaseError as exc:
        if is_damage(exc):
            raise DatabaseDamaged(path, str(exc)) from None
        raise
    if problems != ["ok"]:
        # SQLite may report several problems in one row, one per line, under a "*** in
        # database main ***" heading: the first real one goes in the line, the rest are counted.
        lines = [ln for row in problems for ln in str(row).splitlines() if ln.strip() and not ln.startswith("***")]
        lines = lines or ["unspecified damage"]
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        raise DatabaseDamaged(path, f"quick_check: {lines[0]}{more}")
