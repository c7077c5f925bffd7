"""`eyas show` on the hung-rank run of issue 19 (tui_world.add_hung_run, a store written with fixed
times): what runs now from the stage rows, the running attempt's quiet and exited ranks named, and
each of its ranks' last write."""

from __future__ import annotations

import tui_world as world

from eyas.cli.history import show_lines
from eyas.state import liveness, paths, queries


def test_show_names_the_quiet_rank_and_the_last_writes(tmp_path, monkeypatch):
    world.use_tz_utc(monkeypatch)
    monkeypatch.delenv(liveness.QUIET_ENV, raising=False)  # the default minute
    home = tmp_path / "home"
    world.build(home)
    run_id = world.add_hung_run(home)
    db = queries.connect(paths.db_path(home))
    lines = show_lines(queries.get_run(db, run_id), now=world.NOW)
    # The stored reason is the stale "starting preflight": the state line says what runs now.
    assert lines[2] == "  state:      running (train attempt 1 running)"
    # Under the stages, the running attempt's line: rank 1 exited 1030 s ago, rank 0 last wrote
    # 1032 s ago.
    assert lines[lines.index("  evaluate   pending           0") + 1] == (
        "  train attempt 1: rank 1 exited 0 17m ago; rank 0 still running, quiet 17m"
    )
    at = lines.index("ranks (latest attempt of each stage):")
    assert lines[at + 1].split()[-3:] == ["tok/s", "last", "write"]
    rows = {tuple(ln.split()[:3]): ln.split()[3:] for ln in lines[at + 3 :] if ln.strip()}
    # The running attempt's ranks have an age, the quiet one marked; ended attempts' have none.
    assert rows[("train", "1", "0")] == ["40100", "running", "70.0", "GiB", "17m12s", "(quiet)"]
    assert rows[("train", "1", "1")] == ["40101", "exited", "exit", "0", "69.0", "GiB", "17m11s"]
    assert rows[("vocab", "1", "1")] == ["40101", "exited", "exit", "0"]

    # 59 s after rank 0's last write: not quiet yet, but the stage has partly exited.
    lines = show_lines(queries.get_run(db, run_id), now=world.HUNG_QUIET + 59)
    assert "  train attempt 1: rank 1 exited 0 57s ago; rank 0 still running" in lines
    assert "(quiet)" not in "\n".join(lines)
