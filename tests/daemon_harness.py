"""A real eyas daemon for tests: started as its own process on a private state directory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from eyas.daemon.client import Client, DaemonError, DaemonNotRunning
from eyas.state import paths, queries, store

EYAS = str(Path(sys.executable).with_name("eyas"))


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def selftest_toml(name: str, ranks: int = 2, options: dict | None = None, max_restarts: int = 0,
                  backoff: float = 0.1, devices: str = '"cpu"') -> str:
    opts = ", ".join(f"{k} = {json.dumps(v)}" for k, v in (options or {}).items())
    return (f'name = "{name}"\npipeline = ["selftest"]\n[resources]\nranks = {ranks}\ndevices = {devices}\n'
            f"[stages.selftest]\nmax_restarts = {max_restarts}\nbackoff = {backoff}\noptions = {{ {opts} }}\n")


class Daemon:
    def __init__(self, home: Path, grace: float = 3.0, extra_env: dict | None = None):
        self.home = home
        self.grace = grace
        self.extra_env = extra_env or {}
        self.proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict:
        return {**os.environ, "EYAS_HOME": str(self.home), **self.extra_env}

    @property
    def socket(self) -> Path:
        return paths.socket_path(self.home)

    def start(self) -> "Daemon":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "eyas.daemon.main", "--home", str(self.home), "--grace", str(self.grace)],
            env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(self.home / "daemon.stderr", "ab"), start_new_session=True,
        )
        wait_for(self._pingable, 30, what="the daemon to answer")
        return self

    def _pingable(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"daemon exited {self.proc.returncode}: "
                                 + (self.home / "daemon.stderr").read_text()[-3000:])
        try:
            with Client(self.socket, timeout=2) as c:
                return c.request("ping")["pid"] == self.proc.pid
        except (DaemonNotRunning, DaemonError, OSError):
            return False

    def request(self, op: str, **args):
        with Client(self.socket, timeout=30) as c:
            return c.request(op, **args)

    def submit(self, toml: str, name: str = "run.toml") -> int:
        path = self.home / name
        path.write_text(toml)
        return self.request("submit", config_path=str(path))["run_id"]

    def cli(self, *args, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([EYAS, *map(str, args)], env={**self.env, "TZ": "UTC"}, capture_output=True,
                              text=True, timeout=timeout)

    def reader(self):
        return store.open_reader(paths.db_path(self.home))

    def run(self, run_id: int) -> dict:
        db = self.reader()
        try:
            return queries.get_run(db, run_id)
        finally:
            db.conn.close()

    def wait_run(self, run_id: int, states=("succeeded", "failed", "cancelled"), timeout: float = 60) -> dict:
        return wait_for(lambda: (r := self.run(run_id))["state"] in states and r, timeout,
                        what=f"run {run_id} to become {'/'.join(states)}")

    def ranks(self, run_id: int, stage: str = "selftest", attempt: int | None = None) -> list[dict]:
        stages = {s["name"]: s for s in self.run(run_id)["stages"]}
        attempts = stages[stage]["attempt_list"]
        if not attempts:
            return []
        chosen = attempts[-1] if attempt is None else attempts[attempt - 1]
        return chosen["ranks"]

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.request("shutdown", grace=1.0)
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
            self.proc.wait(10)

    def cleanup(self) -> None:
        """Stop the daemon and make sure no rank process of this home outlives the test."""
        self.stop()
        home = str(self.home)
        for p in psutil.process_iter(["environ"]):
            try:
                if (p.info["environ"] or {}).get("EYAS_HOME") == home and p.pid != os.getpid():
                    p.kill()
            except psutil.Error:
                pass


def short_tmp() -> Path:
    """AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer."""
    return Path(tempfile.mkdtemp(prefix="ey", dir="/tmp"))


@pytest.fixture
def daemon(monkeypatch):
    """A real daemon on a private state directory; torn down with all its ranks."""
    home = short_tmp()
    monkeypatch.setenv("EYAS_HOME", str(home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(home / "rt"))
    d = Daemon(home).start()
    try:
        yield d
    finally:
        d.cleanup()
        shutil.rmtree(home, ignore_errors=True)
