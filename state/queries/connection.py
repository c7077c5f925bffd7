"""The read-only connection every query runs on, and the one way they read rows as dicts.

A plain sqlite3 connection, not sqlite_utils: importing sqlite_utils costs about 0.5 s (it imports
pandas and numpy when they are installed), which alone would break the CLI's 0.5 s budget.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

# The schema version these queries read (schema.LATEST, checked by a test): kept here
# because importing eyas.state.schema pulls in sqlite_utils.
SCHEMA_VERSION = 8


def read_rows(db, sql: str, params: list | tuple = ()) -> list[dict[str, Any]]:
    """Rows as dicts, whatever the connection's row factory."""
    cur = db.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def connect(path: Path) -> sqlite3.Connection:
    """A plain read-only connection for the CLI, daemon running or not (no sqlite_utils).

    Raises FileNotFoundError when there is no database yet (or an empty one the daemon has
    not migrated), RuntimeError when its schema is newer than these queries.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no eyas database at {path}: nothing has been submitted yet")
    # as_uri() percent-encodes, so a path with '?' or '#' stays a path.
    conn = sqlite3.connect(path.absolute().as_uri() + "?mode=ro", uri=True, timeout=30, check_same_thread=False)
    found = conn.execute("PRAGMA user_version").fetchone()[0]
    if found == 0:
        conn.close()
        raise FileNotFoundError(f"eyas database at {path} has no tables yet: nothing has been submitted yet")
    if found > SCHEMA_VERSION:
        conn.close()
        raise RuntimeError(f"database schema {found} is newer than this eyas ({SCHEMA_VERSION}); upgrade eyas")
    return conn
