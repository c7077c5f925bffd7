"""The daemon stays reachable and single when its runtime directory is removed under it.

On a real host that is an SSH logout (systemd-logind removes /run/user/<uid> with the last
session) or a /tmp cleaner during a long run. Real daemon processes, real sockets, the real
`eyas` CLI with the environment a user would have.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from daemon_harness import EYAS, Daemon, selftest_toml, short_tmp, wait_for

from eyas.state import paths

pytestmark = pytest.mark.timeout(180)

# The brief's bound: a client answers within this long after the directory went away.
REACHABLE_WITHIN_S = 5.0
# Where the socket goes when $XDG_RUNTIME_DIR is unset or gone.
TMP_ROOT = Path("/tmp") / f"eyas-{os.getuid()}"


def daemons_of(home: Path) -> list[psutil.Process]:
    """Live processes running `eyas.daemon.main --home HOME`."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if "eyas.daemon.main" in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            if any(a == "--home" and b == str(home) for a, b in zip(cmd, cmd[1:])):
                found.append(p)
    return found


@pytest.fixture
def home(monkeypatch):
    """A state directory whose daemon (and clients) get an existing XDG_RUNTIME_DIR."""
    home = short_tmp()
    (home / "rt").mkdir(mode=0o700)
    monkeypatch.setenv("EYAS_HOME", str(home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(home / "rt"))
    key = paths.runtime_dir(home).name
    yield home
    for p in daemons_of(home):
        p.kill()
    shutil.rmtree(TMP_ROOT / key, ignore_errors=True)  # the /tmp fallback, when a test made one
    shutil.rmtree(home, ignore_errors=True)


def _cli(env: dict, *args, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([EYAS, *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "removed, client_xdg",
    [
        ("root", True),  # logout: $XDG_RUNTIME_DIR itself is gone
        ("own", True),  # a cleaner removed the daemon's <hash> directory
        ("own", False),  # ... and the client (cron, another SSH session) has no XDG_RUNTIME_DIR
    ],
    ids=["xdg-root-removed", "own-dir-removed", "own-dir-removed-client-without-xdg"],
)
def test_the_daemon_stays_reachable_and_single_when_its_runtime_dir_is_removed(home, removed, client_xdg):
    d = Daemon(home).start()
    try:
        served = d.socket
        rt = home / "rt"
        assert served.parent.parent.parent == rt
        record = json.loads((home / "daemon.json").read_text())
        assert (record["pid"], record["socket"]) == (d.proc.pid, str(served))
        assert stat.S_IMODE((home / "daemon.json").stat().st_mode) == 0o600
        run_id = d.submit(selftest_toml("away", ranks=1, options={"steps": 60, "step_time": 0.1}))
        d.wait_run(run_id, states=("running",), timeout=30)

        shutil.rmtree(rt if removed == "root" else served.parent)
        gone_at = time.monotonic()
        env = {**d.env, "TZ": "UTC"}
        if not client_xdg:
            env.pop("XDG_RUNTIME_DIR")
        status = wait_for(
            lambda: (out := _cli(env, "daemon", "status", "--json")).returncode == 0 and out,
            REACHABLE_WITHIN_S,
            interval=0.1,
            what="`eyas daemon status` to find the daemon",
        )
        answered = time.monotonic() - gone_at
        print(f"status answered {answered:.2f} s after the runtime directory was removed")
        info = json.loads(status.stdout)
        assert info["pid"] == d.proc.pid and info["active"] and info["active"][0]["run_id"] == run_id

        # The socket it reports is the one it serves, private as before.
        now = Path(info["socket"])
        assert stat.S_ISSOCK(now.lstat().st_mode) and stat.S_IMODE(now.stat().st_mode) == 0o600
        assert stat.S_IMODE(now.parent.stat().st_mode) == 0o700
        if removed == "root":
            assert not rt.exists()  # not made again where logind mounts the next session's
            assert now.parent.parent == TMP_ROOT
        else:
            assert now == served  # made again in place
        assert json.loads((home / "daemon.json").read_text())["socket"] == str(now)
        if not client_xdg:  # found through the record, not the path this client computes
            assert now.parent.parent != TMP_ROOT

        again = _cli(env, "daemon", "start")
        assert (again.returncode, again.stdout.strip()) == (
            0,
            f"eyas daemon already running (pid {d.proc.pid}) for {home}",
        ), again.stderr
        assert [p.pid for p in daemons_of(home)] == [d.proc.pid]

        run = d.wait_run(run_id, timeout=60)
        assert run["state"] == "succeeded"
        log = (home / "daemon.log").read_text()
        assert f"socket {served} is gone; serving again on {now}" in log
        assert d.cli("daemon", "stop").returncode == 0
        assert d.proc.wait(30) == 0
        assert not (home / "daemon.json").exists()
    finally:
        d.cleanup()


def test_the_lock_lives_in_the_state_directory(home):
    d = Daemon(home).start()
    try:
        assert paths.lock_path(home) == home / "daemon.lock"
        assert int(paths.lock_path(home).read_text()) == d.proc.pid
        shutil.rmtree(home / "rt")
        second = subprocess.Popen(
            [sys.executable, "-m", "eyas.daemon.main", "--home", str(home)],
            env=d.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = second.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            second.kill()
            second.wait()
            raise AssertionError("a second daemon ran on the same state directory") from None
        assert second.returncode == 1 and f"an eyas daemon (pid {d.proc.pid}) already runs for {home}" in err
        assert [p.pid for p in daemons_of(home)] == [d.proc.pid]
    finally:
        d.cleanup()


def test_racing_starts_give_one_daemon(home):
    env = {**os.environ, "TZ": "UTC"}
    for round_ in range(4):
        starts = [
            subprocess.Popen(
                [EYAS, "daemon", "start"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for _ in range(2)
        ]
        outs = [p.communicate(timeout=60) for p in starts]
        daemons = daemons_of(home)
        try:
            assert len(daemons) == 1, (round_, outs)
            pid = daemons[0].pid
            assert [p.returncode for p in starts] == [0, 0], (round_, outs)
            firsts = sorted(out.splitlines()[0] for out, _ in outs)
            assert firsts == [
                f"eyas daemon already running (pid {pid}) for {home}",
                f"eyas daemon started (pid {pid})",
            ], (round_, outs)
        finally:
            stop = _cli(env, "daemon", "stop")
            assert stop.returncode == 0, stop.stderr
            wait_for(lambda: not daemons_of(home), 30, what="the daemon to exit")


def test_a_daemon_that_does_not_answer_is_one_line_not_a_traceback(home):
    """Something holds the socket and accepts, but never replies (a stuck or swamped daemon)."""
    import socket

    path = paths.socket_path(home)
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(str(path))
    mute.listen(8)
    try:
        t0 = time.monotonic()
        out = _cli(dict(os.environ), "daemon", "status")
        waited = time.monotonic() - t0
    finally:
        mute.close()
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        f"eyas daemon: the daemon did not answer in time on {path}; it is busy or stuck: see {home / 'daemon.log'}"
    ]
    assert waited < 30  # the client's own request limit, not a hang
