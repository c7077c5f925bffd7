"""A full state directory is a recorded failure, not a lost one: real daemon, real ranks, a
small tmpfs as EYAS_HOME filled up by the ranks' own logs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from daemon_harness import Daemon, selftest_toml, short_tmp, wait_for

from eyas.state import paths
from eyas.wire.client import DaemonError

SIZE_MB = 15
# What the ranks' logs are left to fill: the test writes a filler for the rest, so that the
# disk fills within seconds whatever bounds a rank log may get.
LEFT_FOR_LOGS = 2 << 20


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def small_home(monkeypatch):
    base = short_tmp()
    home = base / "home"
    home.mkdir()
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE_MB}m", "tmpfs", str(home)], capture_output=True, text=True
    )
    if out.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"mounting a {SIZE_MB} MB tmpfs is not permitted here (needs root): {out.stderr.strip()}")
    (base / "rt").mkdir(mode=0o700)  # the socket lives off the full disk, as under /run/user
    monkeypatch.setenv("EYAS_HOME", str(home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base / "rt"))
    try:
        yield home
    finally:
        if subprocess.run(["umount", str(home)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(home)], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def _status(d: Daemon) -> dict:
    return json.loads(d.cli("daemon", "status", "--json").stdout)


def test_a_full_state_directory_fails_the_attempt_with_enospc_and_starts_nothing(small_home):
    d = Daemon(small_home).start()
    try:
        run_id = d.submit(
            selftest_toml(
                "flood", ranks=2, max_restarts=0, options={"lines_per_sec": 20000, "duration": 120, "step_time": 0.05}
            )
        )
        pids = wait_for(
            lambda: (p := [r["pid"] for r in d.ranks(run_id)]) and len(p) == 2 and all(p) and p, 30, what="rank pids"
        )
        st = os.statvfs(small_home)
        filler = small_home / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - LEFT_FOR_LOGS))

        full = wait_for(
            lambda: (
                (out := d.cli("daemon", "status")).returncode == 0
                and "state directory full: " in out.stdout
                and out.stdout
            ),
            60,
            what="daemon status to say the state directory is full",
        )
        assert "ENOSPC while" in full, full
        wait_for(lambda: not any(_alive(p) for p in pids), 60, what="the ranks to end on the full disk")
        # While the disk is full: no attempt beyond the first, whatever was or was not written.
        assert _status(d)["full"] is not None
        assert len(d.run(run_id)["stages"][0]["attempt_list"]) == 1
        # A run submitted now is refused, and leaves no folder behind it.
        folders = sorted(p.name for p in paths.runs_dir(small_home).iterdir())
        elsewhere = Path(tempfile.mkdtemp()) / "later.toml"
        elsewhere.write_text(selftest_toml("while-full", ranks=1))
        with pytest.raises(DaemonError) as refused:
            d.request("submit", config_path=str(elsewhere))
        assert refused.value.code == "state_full" and "was not done" in refused.value.message
        assert sorted(p.name for p in paths.runs_dir(small_home).iterdir()) == folders

        # Space returns: the filler and the rank logs go.
        attempt_dir = Path(d.run(run_id)["stages"][0]["attempt_list"][0]["dir"])
        state_while_full = d.run(run_id)["stages"][0]["attempt_list"][0]["state"]
        freed = time.monotonic()
        filler.unlink()
        logs = sorted(str(log) for log in attempt_dir.glob("rank-*.log"))
        for log in logs:
            os.unlink(log)
        run = d.wait_run(run_id, ("failed",), timeout=60)
        recorded = time.monotonic() - freed
        wait_for(lambda: _status(d)["full"] is None, 30, what="the condition to clear")
        cleared = time.monotonic() - freed
        print(f"\nrecovery: end recorded {recorded:.2f} s, condition cleared {cleared:.2f} s after space returned")
        print(f"status while full: {full.strip()}\nattempt state just before space returned: {state_while_full}")

        stage = run["stages"][0]
        (attempt,) = stage["attempt_list"]  # max_restarts = 0: nothing unrequested started
        root = attempt["root_cause"]
        assert (stage["state"], attempt["state"]) == ("failed", "failed")
        # The file the rank could not write (its log: stdout, which the flood filled), and its own
        # traceback as it raised it: the writer's frame and the OSError, not the log's last lines.
        log = str(attempt_dir / f"rank-{root['rank']}.log")
        oserror = f"OSError: [Errno 28] No space left on device: '{log}'"
        assert log in logs, (log, logs)  # a file that was there, not a record that never was
        assert (root["type"], root["source"]) == ("ENOSPC", "disk_full"), root
        assert root["message"] == (
            f"ENOSPC while writing {log} (the state directory {small_home} was full); rank {root['rank']} "
            f"(pid {root['pid']}) raised {oserror}"
        ), root
        assert root["path"] == str(attempt_dir / f"rank-{root['rank']}.error.json") and os.path.exists(root["path"])
        tb = root["traceback"]
        assert tb.startswith("Traceback (most recent call last):\n") and tb.rstrip("\n").endswith(oserror), tb
        assert re.search(r'selftest\.py", line \d+, in _flood\n\s+sys\.stdout\.write\(', tb), tb
        assert not re.search(r"^r\d line \d+", tb, re.M), tb
        assert "ENOSPC" in attempt["reason"] or "No space left" in attempt["reason"], attempt["reason"]
        errors = d.cli("errors", run_id)
        assert errors.returncode == 0 and ("ENOSPC" in errors.stdout or "No space left" in errors.stdout), errors
        assert "Lost" not in errors.stdout
        assert not re.search(r"^\s*r\d line \d+", errors.stdout, re.M), errors.stdout  # no rank's flood
        time.sleep(2.0)
        assert len(d.run(run_id)["stages"][0]["attempt_list"]) == 1

        # A restarted daemon finds the record true and leaves it as it is.
        before = d.run(run_id)
        d.kill9()
        d.start()
        time.sleep(2.0)
        after = d.run(run_id)
        assert after == before
        assert "Lost" not in d.cli("errors", run_id).stdout
    finally:
        d.cleanup()


async def test_the_tui_says_the_state_directory_is_full_while_it_is(small_home):
    from tui_world import until

    from eyas.tui.app import EyasApp
    from eyas.tui.widgets.chrome import Banner, TopBar

    d = Daemon(small_home).start()
    try:
        app = EyasApp(small_home, socket=d.socket)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.link.connected, what="the connection")
            banner = app.screen.query_one(Banner)
            assert not banner.has_class("full")
            st = os.statvfs(small_home)
            filler = small_home / "filler"
            with open(filler, "wb") as f:  # all but half a MiB: under the daemon's 1 MiB floor
                f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - (512 << 10)))
            await until(pilot, lambda: banner.has_class("full"), timeout=20, what="the full-disk banner")
            text = str(banner.render())
            assert "state directory is full (ENOSPC while checking free space in" in text, text
            assert "state dir full" in str(app.screen.query_one(TopBar).render())
            filler.unlink()
            await until(pilot, lambda: not banner.has_class("full"), timeout=30, what="the banner to go")
            assert str(banner.render()) == ""
    finally:
        d.cleanup()
