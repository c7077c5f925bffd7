"""The state directory is owner-only (state/privacy.py): a real daemon, started by `eyas daemon
start` from a process with the permissive umask 022, runs real selftest ranks, and nothing it,
its monitors or its ranks made in the state directory has a group or other bit; the outputs of
a run whose output_dir the user chose keep that umask; and a state directory an older eyas
left world-readable is made owner-only at start-up. A Slurm attempt (a real one-node cluster,
tests/support/slurm_world.py) is held to the same rule: its batch script, job record, Slurm's
output file and the tasks' logs and records."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import slurm_world
from daemon_harness import Daemon, selftest_toml, short_tmp
from runtoml import run_toml

from eyas.state import paths, store

pytestmark = pytest.mark.timeout(180)

USER_UMASK = 0o022


@pytest.fixture
def world(monkeypatch):
    """(home, elsewhere): a state directory path that does not exist yet, and a folder beside
    it for what is not eyas's (run configs, a shared output folder, the runtime directory);
    the test process's umask is 022 meanwhile, which `eyas daemon start` hands to the daemon."""
    base = short_tmp()
    home, elsewhere = base / "state", base / "elsewhere"
    (elsewhere / "rt").mkdir(parents=True, mode=0o700)
    monkeypatch.setenv("EYAS_HOME", str(home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(elsewhere / "rt"))
    old = os.umask(USER_UMASK)
    d = Daemon(home)
    try:
        yield d, elsewhere
    finally:
        os.umask(old)
        d.cli("daemon", "stop")
        d.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def shared(d: Daemon) -> list[str]:
    """Everything under the state directory (itself included) with a group or other bit, as
    'path mode'. Symbolic links have no mode of their own on Linux and are skipped."""
    found = _if_shared(str(d.home))
    for root, dirs, files in os.walk(d.home):
        for name in dirs + files:
            found += _if_shared(os.path.join(root, name))
    return found


def _if_shared(path: str) -> list[str]:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_IMODE(st.st_mode) & 0o077:
        return []
    return [f"{path} {stat.S_IMODE(st.st_mode):04o}"]


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def start(d: Daemon) -> None:
    out = d.cli("daemon", "start")
    assert out.returncode == 0, out.stdout + out.stderr


def submit(d: Daemon, elsewhere: Path, toml: str, name: str) -> int:
    path = elsewhere / f"{name}.toml"  # the user's file, outside the state directory
    path.write_text(toml)
    return d.request("submit", config_path=str(path))["run_id"]


def test_everything_the_daemon_and_its_ranks_make_in_the_state_directory_is_owner_only(world):
    d, elsewhere = world
    start(d)
    own = submit(d, elsewhere, selftest_toml("own", ranks=2, options={"steps": 3, "step_time": 0.05}), "own")
    d.wait_succeeded(own)
    # A run whose outputs go to a folder the user chose, two levels of it missing yet.
    out = elsewhere / "team" / "drafts"
    toml = run_toml(
        "team",
        ["selftest"],
        output_dir=out,
        resources={"ranks": 1, "devices": "cpu"},
        stages={"selftest": {"max_restarts": 0, "stall_timeout": 0, "options": {"steps": 3, "step_time": 0.05}}},
    )
    team = submit(d, elsewhere, toml, "team")
    d.wait_succeeded(team)

    # The walk is not vacuous: what the daemon, the CLI, the monitors and the ranks write is there.
    attempt = Path(d.run(own)["dir"]) / "selftest" / "attempt-1"
    team_attempt = Path(d.run(team)["dir"]) / "selftest" / "attempt-1"
    expected = [
        d.home / "eyas.db",
        d.home / "eyas.db-wal",  # the daemon still runs: its WAL and shared memory are open
        d.home / "eyas.db-shm",
        d.home / "daemon.log",
        d.home / "daemon.lock",
        d.home / "daemon.json",
        d.home / "daemon.out",  # written by `eyas daemon start`
        d.home / "runs",
        attempt.parent.parent / "config.json",
        attempt.parent.parent / "out" / "selftest" / "rank-1.done",  # the default outputs are state
        *(attempt / f"rank-{r}.{kind}" for r in (0, 1) for kind in ("log", "proc.json", "exit.json", "done.json")),
        *(attempt / f"rank-{r}.progress.jsonl" for r in (0, 1)),
        team_attempt / "rank-0.done.json",
        team_attempt / "rank-0.exit.json",
    ]
    missing = [str(p) for p in expected if not os.path.lexists(p)]
    assert not missing, f"expected files missing: {missing}"
    offenders = shared(d)
    assert not offenders, "group or other bits in the state directory:\n" + "\n".join(offenders)
    assert mode(d.home) == 0o700

    # The outputs in the user's own folder keep their umask: the missing folders the daemon
    # made, the stage's folder and file the rank made.
    assert {p.name: mode(p) for p in (out.parent, out, out / "selftest", out / "selftest" / "rank-0.done")} == {
        "team": 0o755,
        "drafts": 0o755,
        "selftest": 0o755,
        "rank-0.done": 0o644,
    }
    # The socket's folders, made by the test's process and the daemon, are 0700 too.
    assert mode(d.socket.parent) == 0o700 and mode(d.socket.parent.parent) == 0o700


def test_a_state_directory_left_world_readable_is_made_owner_only_at_start(world):
    d, elsewhere = world
    # What an older eyas left with umask 022: the folder, its database and logs, an old run.
    d.home.mkdir(mode=0o755)
    store.open_writer(paths.db_path(d.home)).conn.close()
    (d.home / "daemon.log").write_text("an old line\n")
    (d.home / "daemon.lock").write_text("123\n")
    old_run = d.home / "runs" / "7"
    old_run.mkdir(parents=True)
    (old_run / "config.json").write_text("{}")
    notes = d.home / "notes.txt"  # not a name of eyas's: the user's own, left as it is
    notes.write_text("mine\n")
    linked = elsewhere / "linked.log"  # a link in eyas's place: its target is left alone
    linked.write_text("")
    (d.home / "daemon.log.1").symlink_to(linked)
    before = {p: mode(p) for p in (d.home, d.home / "eyas.db", d.home / "runs", old_run, notes, linked)}
    assert set(before.values()) == {0o755, 0o644}, before

    start(d)
    assert {p.name: mode(p) for p in (d.home, d.home / "eyas.db", d.home / "daemon.log", d.home / "daemon.lock")} == {
        d.home.name: 0o700,
        "eyas.db": 0o600,
        "daemon.log": 0o600,
        "daemon.lock": 0o600,
    }
    assert mode(d.home / "runs") == 0o700
    # Not recursive: an old run's folder keeps its mode, out of reach behind runs/.
    assert (mode(old_run), mode(old_run / "config.json")) == (0o755, 0o644)
    assert mode(notes) == 0o644 and mode(linked) == 0o644
    log = (d.home / "daemon.log").read_text()
    for path, was, now in (
        (d.home, "0755", "0700"),
        (d.home / "eyas.db", "0644", "0600"),
        (d.home / "runs", "0755", "0700"),
    ):
        assert f"made owner-only (it holds prompts, data paths and tracebacks): {path}: {was} -> {now}" in log, log
    # The new run's files, in the same runs/, are owner-only from the first.
    run_id = submit(d, elsewhere, selftest_toml("after", ranks=1, options={"steps": 2, "step_time": 0.05}), "after")
    d.wait_succeeded(run_id)
    run_dir = Path(d.run(run_id)["dir"])
    assert run_dir.parent == d.home / "runs"
    offenders = [line for line in shared(d) if not line.startswith((str(old_run), str(notes)))]
    assert not offenders, "group or other bits in the state directory:\n" + "\n".join(offenders)


def test_a_slurm_attempt_is_owner_only_too(world):
    reason = slurm_world.slurm_unavailable()
    if reason:
        pytest.skip(reason)
    d, elsewhere = world
    with slurm_world.running() as cluster:
        d.extra_env = {"SLURM_CONF": str(cluster.conf), slurm_world.MARK: str(cluster.root)}
        start(d)
        try:
            toml = run_toml(
                "slurm",
                ["selftest"],
                resources={"ranks": 2, "devices": "cpu", "executor": "slurm"},
                stages={
                    "selftest": {"max_restarts": 0, "stall_timeout": 0, "options": {"steps": 3, "step_time": 0.05}}
                },
            )
            run_id = submit(d, elsewhere, toml, "slurm")
            d.wait_succeeded(run_id, timeout=120)
            attempt = Path(d.run(run_id)["dir"]) / "selftest" / "attempt-1"
            made = sorted(p.name for p in attempt.iterdir())
            assert {"job.sbatch", "slurm-job.json", "rank-0.log", "rank-1.log", "rank-1.exit.json"} <= set(made), made
            assert any(n.startswith("slurm-") and n.endswith(".out") for n in made), made
            offenders = shared(d)
            assert not offenders, "group or other bits in the state directory:\n" + "\n".join(offenders)
        finally:
            d.cli("daemon", "stop")
