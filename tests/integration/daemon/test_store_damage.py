"""A damaged database: the daemon refuses it at start and the history commands say so, each in
one line naming the file and the fix, never a traceback. Real eyas.db files damaged on disk,
the real daemon entry point and the real CLI as subprocesses."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from eyas.state import integrity, paths, store

RUNS = 400  # enough rows that the runs table spans many b-tree pages


def make_home(home: Path) -> Path:
    """A real eyas.db with RUNS runs, closed cleanly (WAL checkpointed into the file)."""
    path = paths.db_path(home)
    db = store.open_writer(path)
    for i in range(RUNS):
        store.create_run(db, name=f"run-{i}", model="m" * 40, stages=[{"name": "prepare"}], now=1000.0 + i)
    db.conn.close()
    assert not path.with_name(path.name + "-wal").exists()
    return path


def damage_header(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(b"\xa5" * 100)  # the 100-byte header, magic string included


def damage_page(path: Path) -> int:
    """Overwrite the cells of one leaf page of the runs table (a child of its interior root
    page), leaving the page's own header, the file's header and the schema intact, so that
    quick_check reports the bad records (a wholly overwritten page makes it raise instead);
    returns the page number."""
    conn = sqlite3.connect(path)
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'runs'").fetchone()[0]
    conn.close()
    data = path.read_bytes()
    page = data[(root - 1) * page_size : root * page_size]
    assert page[0] == 0x05, "the runs table fits one page: add rows"  # an interior table b-tree page
    first_cell = int.from_bytes(page[12:14], "big")
    child = int.from_bytes(page[first_cell : first_cell + 4], "big")
    leaf = data[(child - 1) * page_size : child * page_size]
    assert leaf[0] == 0x0D  # a leaf table b-tree page
    cells = int.from_bytes(leaf[5:7], "big")  # where its cell content starts
    with open(path, "r+b") as f:
        f.seek((child - 1) * page_size + cells)
        f.write(b"\xa5" * (page_size - cells))
    return child


def daemon_main(home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EYAS_HOME"}
    return subprocess.run(
        [sys.executable, "-m", "eyas.daemon.main", "--home", str(home), "--grace", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def assert_one_line(p: subprocess.CompletedProcess, prefix: str, path: Path, detail: str) -> None:
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"{prefix}: {path}: the eyas database is damaged (")
    assert detail in lines[0]
    assert lines[0].endswith(f"restore a backup, or move it aside to start a new history: mv {path} {path}.damaged")


def test_a_damaged_header_is_one_line_for_the_daemon_and_every_history_command(tmp_path, eyas_cli):
    path = make_home(tmp_path)
    damage_header(path)
    assert_one_line(daemon_main(tmp_path), "eyas daemon", path, "file is not a database")
    assert "the eyas database is damaged" in (tmp_path / "daemon.log").read_text()  # and in its log
    for argv in (["runs"], ["runs", "--json"], ["show", "1"], ["errors", "1"], ["logs", "1"]):
        assert_one_line(eyas_cli(tmp_path, *argv), f"eyas {argv[0]}", path, "file is not a database")


def test_a_damaged_page_is_found_at_daemon_start(tmp_path, eyas_cli):
    path = make_home(tmp_path)
    page = damage_page(path)
    # The header is fine (the file opens, the schema reads); only the integrity check sees it.
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] > 0
    problems = [r[0] for r in conn.execute("PRAGMA quick_check").fetchall()]
    conn.close()
    assert problems != ["ok"] and f"On tree page {page} cell" in problems[0], problems
    p = daemon_main(tmp_path)
    assert_one_line(p, "eyas daemon", path, f"quick_check: On tree page {page} cell ")
    # The runs listing reads the damaged page too.
    assert_one_line(eyas_cli(tmp_path, "runs"), "eyas runs", path, "database disk image is malformed")


def test_the_fix_moves_a_crashed_writers_log_too(tmp_path, eyas_cli):
    """A daemon killed mid-write leaves a write-ahead log with content; a reader cannot fold it
    back into the file, and a new database must not inherit it, so the fix moves it as well."""
    path = make_home(tmp_path)
    damage_page(path)
    crash = (
        "import os, sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1]); c.execute('PRAGMA wal_autocheckpoint = 0')\n"
        "c.execute(\"INSERT INTO events (time, entity, to_state, reason) VALUES (1, 'run', 'x', 'x')\")\n"
        "c.commit(); os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", crash, str(path)], check=True, timeout=60)
    wal = Path(f"{path}-wal")
    assert wal.stat().st_size > 0
    p = eyas_cli(tmp_path, "runs")
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.endswith(f"mv {path} {path}.damaged && mv {wal} {wal}.damaged\n")


def test_a_healthy_store_opens_and_a_busy_one_is_no_damage(tmp_path):
    path = make_home(tmp_path)
    store.open_writer(path).conn.close()  # quick_check passes on a healthy file
    locked = sqlite3.OperationalError("database is locked")
    locked.sqlite_errorcode = 5  # SQLITE_BUSY: an OperationalError, not damage
    assert not integrity.is_damage(locked)
