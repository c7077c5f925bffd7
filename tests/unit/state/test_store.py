"""The run store's own rules: migrations, retention, the OOM counter reader."""

from __future__ import annotations

import sqlite3

import pytest

from eyas.daemon import oom
from eyas.state import machine, queries, schema, store


def test_fresh_store_is_migrated_in_wal_mode_and_readers_cannot_write(tmp_path):
    db = store.open_writer(tmp_path / "e.db")
    assert schema.version(db) == schema.LATEST == queries.SCHEMA_VERSION
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert {"runs", "stages", "attempts", "ranks", "errors", "metrics", "events"} <= set(db.table_names())
    reader = store.open_reader(tmp_path / "e.db")
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        reader.execute("INSERT INTO runs (name, state, created_at) VALUES ('x', 'pending', 1)")
    # Opening again migrates nothing twice.
    assert schema.migrate(store.open_writer(tmp_path / "e.db")) == schema.LATEST


def test_reader_refuses_a_missing_or_newer_database(tmp_path):
    with pytest.raises(store.StoreMissing, match="nothing has been submitted yet"):
        store.open_reader(tmp_path / "none.db")
    db = store.open_writer(tmp_path / "e.db")
    db.execute(f"PRAGMA user_version = {schema.LATEST + 1}")
    with pytest.raises(RuntimeError, match="newer than this eyas"):
        store.open_reader(tmp_path / "e.db")


def test_a_migration_that_fails_halfway_leaves_nothing_behind(tmp_path, monkeypatch):
    db = store.open_writer(tmp_path / "e.db")
    columns_before = {c.name for c in db["ranks"].columns}

    def half_done(db):
        db["ranks"].add_column("half_done", str)  # DDL first, as a real migration would
        raise RuntimeError("migration 3 failed after its first column")

    monkeypatch.setattr(schema, "MIGRATIONS", [*schema.MIGRATIONS, half_done])
    monkeypatch.setattr(schema, "LATEST", len(schema.MIGRATIONS))
    with pytest.raises(RuntimeError, match="after its first column"):
        schema.migrate(db)
    assert {c.name for c in db["ranks"].columns} == columns_before
    assert schema.version(db) == schema.LATEST - 1
    # Fixed, the same migration applies on the next start instead of "duplicate column".
    monkeypatch.setattr(
        schema, "MIGRATIONS", [*schema.MIGRATIONS[:-1], lambda db: db["ranks"].add_column("half_done", str)]
    )
    assert schema.migrate(db) == schema.LATEST
    assert "half_done" in {c.name for c in db["ranks"].columns}


def test_the_runs_reason_follows_its_current_stage(tmp_path):
    db = store.open_writer(tmp_path / "e.db")
    run_id = store.create_run(db, name="r", model="m", stages=[{"name": "prepare"}, {"name": "extract"}])
    store.move_run(db, run_id, "running", "starting prepare")  # as the daemon starts a run
    for stage in ("prepare", "extract"):
        store.move_stage(db, run_id, stage, "running", "started")
        store.new_attempt(db, run_id, stage, dir=str(tmp_path / stage), world_size=1)
        row = db["runs"].get(run_id)
        assert (row["current_stage"], row["reason"]) == (stage, f"{stage}: attempt 1 started")
        store.move_stage(db, run_id, stage, "succeeded", "every rank exited 0")
    store.new_attempt(db, run_id, "extract", dir=str(tmp_path / "extract-2"), world_size=1)
    assert db["runs"].get(run_id)["reason"] == "extract: attempt 2 started"


def test_retention_drops_old_samples_then_the_oldest_beyond_the_cap(tmp_path):
    db = store.open_writer(tmp_path / "e.db")
    now = 1_000_000.0
    rows = [
        {"time": now - age, "run_id": 1, "stage": "s", "attempt": 1, "rank": 0, "name": "x", "value": age}
        for age in range(0, 200)
    ]
    store.insert_metrics(db, rows)
    removed = store.prune_metrics(db, max_age_s=149.5, max_rows=100, now=now)
    assert removed == 100  # 50 too old, then the 50 oldest of the 150 left
    ages = sorted(r[0] for r in db.execute("SELECT value FROM metrics"))
    assert ages == [float(a) for a in range(100)]


def test_state_machine_names_the_legal_moves():
    with pytest.raises(machine.IllegalTransition) as err:
        machine.check("stage", "succeeded", "running", "stage train of run 3")
    assert (
        str(err.value)
        == "stage train of run 3 is succeeded; it cannot become running (from succeeded: none: it is final)"
    )
    assert machine.allowed("stage", "failed", "pending")


@pytest.mark.parametrize(
    "text,expected",
    [
        ("low 0\nhigh 0\nmax 0\noom 2\noom_kill 3\n", 3),  # cgroup v2 memory.events
        ("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n", 7),  # cgroup v1 memory.oom_control
        ("oom_kill_disable 0\nunder_oom 0\n", None),  # an old kernel: no counter
    ],
)
def test_oom_counter_is_read_from_either_cgroup_version(tmp_path, text, expected):
    path = tmp_path / "memory.events"
    path.write_text(text)
    assert oom.oom_kill_count([tmp_path / "missing", path]) == expected


def test_oom_counter_on_this_machine_is_a_number_or_absent():
    found = oom.oom_kill_count()
    assert found is None or found >= 0
