"""`eyas demo`: the main job, end to end, leaving nothing running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from daemon_harness import short_tmp, wait_for
from eyas.state import paths, queries, store

EYAS = str(Path(sys.executable).with_name("eyas"))


def _env(home: Path) -> dict:
    return {**os.environ, "EYAS_HOME": str(home), "XDG_RUNTIME_DIR": str(home / "rt"), "COLUMNS": "120"}


def _eyas_processes(home: Path) -> list[int]:
    found = []
    for p in psutil.process_iter(["environ", "cmdline"]):
        try:
            env = p.info["environ"] or {}
            if env.get("EYAS_HOME") == str(home) and p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def test_demo_runs_the_pipeline_and_leaves_nothing_behind():
    home = short_tmp()
    out = subprocess.run([EYAS, "demo"], env=_env(home), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "run 1 demo: succeeded" in out.stdout
    assert "selftest" in out.stdout and "eyas daemon stopped" in out.stdout
    db = store.open_reader(paths.db_path(home))
    run = queries.get_run(db, 1)
    assert run["state"] == "succeeded" and run["tok_s"] > 0
    assert [r["exit_code"] for r in run["stages"][0]["attempt_list"][0]["ranks"]] == [0, 0]
    assert _eyas_processes(home) == []


def test_ctrl_c_stops_the_demo_cleanly():
    home = short_tmp()
    proc = subprocess.Popen([EYAS, "demo"], env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    wait_for(lambda: paths.db_path(home).exists() and _ranks_running(home), 60, what="the demo's ranks")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    run = queries.get_run(store.open_reader(paths.db_path(home)), 1)
    assert (run["state"], run["stages"][0]["state"]) == ("cancelled", "cancelled")
    wait_for(lambda: _eyas_processes(home) == [], 10, what="no process left")


def _ranks_running(home: Path) -> bool:
    try:
        db = store.open_reader(paths.db_path(home))
        rows = db.execute("select count(*) from ranks where pid is not null and state = 'running'").fetchone()[0]
        return rows == 2
    except Exception:
        return False
