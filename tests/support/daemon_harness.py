"""A real eyas daemon for tests: started as its own process on a private state directory."""

from __future__ import annotations

import contextlib
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
from runtoml import run_toml, toml_value

from eyas.state import paths, queries, store
from eyas.wire.client import Client, DaemonError, DaemonNotRunning

EYAS = str(Path(sys.executable).with_name("eyas"))


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def selftest_toml(
    name: str,
    ranks: int = 2,
    options: dict | None = None,
    max_restarts: int = 0,
    backoff: float = 0.1,
    devices: str = '"cpu"',
    stall_timeout: float | None = 0,
    exit_timeout: float | None = None,
    log_max_mb: float | None = None,
) -> str:
    """A selftest run. The stall watchdog is off unless asked for (tests hang ranks on purpose);
    None leaves a bound's key out, so the stage's default applies. `devices` is written as in
    TOML ('"cpu"', "[0]")."""
    return run_toml(
        name,
        ["selftest"],
        resources={"ranks": ranks, "devices": toml_value(devices)},
        stages={
            "selftest": {
                "max_restarts": max_restarts,
                "backoff": backoff,
                "stall_timeout": stall_timeout,
                "exit_timeout": exit_timeout,
                "log_max_mb": log_max_mb,
                "options": options or {},
            }
        },
    )


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

    def start(self) -> Daemon:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "eyas.daemon.main", "--home", str(self.home), "--grace", str(self.grace)],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(self.home / "daemon.stderr", "ab"),
            start_new_session=True,
        )
        try:
            wait_for(self._pingable, 30, what="the daemon to answer")
        except BaseException:
            # A daemon that never answered is not left running under the rest of the suite.
            self.proc.kill()
            self.proc.wait()
            raise
        return self

    def _pingable(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"daemon exited {self.proc.returncode}: " + (self.home / "daemon.stderr").read_text()[-3000:]
            )
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
        return subprocess.run(
            [EYAS, *map(str, args)], env={**self.env, "TZ": "UTC"}, capture_output=True, text=True, timeout=timeout
        )

    def reader(self):
        return store.open_reader(paths.db_path(self.home))

    def run(self, run_id: int) -> dict:
        db = self.reader()
        try:
            return queries.get_run(db, run_id)
        finally:
            db.conn.close()

    def wait_run(self, run_id: int, states=("succeeded", "failed", "cancelled"), timeout: float = 60) -> dict:
        try:
            return wait_for(
                lambda: (r := self.run(run_id))["state"] in states and r,
                timeout,
                what=f"run {run_id} to become {'/'.join(states)}",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnose(run_id)}") from None

    def expect_succeeded(self, run_id: int, run: dict) -> dict:
        """`run` as given if it succeeded; else the test fails with every root cause and the
        run's diagnosis, which is what a red CI run has to go on."""
        if run["state"] != "succeeded":
            roots = [a["root_cause"] for s in run["stages"] for a in s["attempt_list"] if a["root_cause"]]
            pytest.fail(
                f"run {run_id} {run['state']}: {run['reason']}\nroot causes: {json.dumps(roots, indent=1)[:6000]}\n"
                + self.diagnose(run_id)
            )
        return run

    def wait_succeeded(self, run_id: int, timeout: float = 60) -> dict:
        return self.expect_succeeded(run_id, self.wait_run(run_id, timeout=timeout))

    def diagnose(self, run_id: int, lines: int = 40) -> str:
        """What a stuck run was doing: its stages, each live rank's Python stacks and log tail,
        and every process of this home. A CI timeout is otherwise only "timed out"."""
        run = self.run(run_id)
        out = [f"run {run_id}: {run['state']} (stage {run['stage']}); load average {psutil.getloadavg()}"]
        out += ["  busiest processes on the machine:"] + [f"    {line}" for line in _busiest()]
        for p in self._home_processes():
            try:
                cpu = sum(p.cpu_times()[:2])
                out.append(f"  pid {p.pid} {p.status()} cpu {cpu:.1f}s: {' '.join(p.cmdline())[:160]}")
            except psutil.Error:
                pass
        try:  # each live rank writes its stacks into its log (eyas stacks)
            self.request("stacks", run=run_id)
            time.sleep(1.0)
        except Exception as exc:  # noqa: BLE001 - a diagnosis must not hide the timeout
            out.append(f"  (no stacks: {exc})")
        for s in run["stages"]:
            out.append(f"stage {s['name']}: {s['state']} attempts {s['attempts']} reason {s['reason']}")
            if s["state"] not in ("running", "failed") or not s["attempt_list"]:
                continue
            for r in s["attempt_list"][-1]["ranks"]:
                out.append(f"  rank {r['rank']} pid {r['pid']} {r['state']} exit {r['exit_code']} log {r['log_path']}")
                try:
                    text = Path(r["log_path"]).read_text(errors="replace")
                    out += ["    | " + line for line in text.splitlines()[-lines:]]
                except (OSError, TypeError):
                    pass
        log = self.home / "daemon.log"
        if log.exists():
            out += ["daemon.log:"] + ["  | " + line for line in log.read_text(errors="replace").splitlines()[-lines:]]
        return "\n".join(out)

    def _home_processes(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["environ"]):
            try:
                if (p.info["environ"] or {}).get("EYAS_HOME") == str(self.home) and p.pid != os.getpid():
                    found.append(p)
            except psutil.Error:
                pass
        return found

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
        for p in self._home_processes():
            try:
                p.kill()
            except psutil.Error:
                pass


def _busiest(n: int = 6, window: float = 0.5) -> list[str]:
    """The processes using the most CPU over `window` seconds: a leftover of an earlier test
    spinning on both cores looks, from inside a test, like a hang."""
    procs = list(psutil.process_iter(["pid", "cmdline"]))
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(window)
    rows = []
    for p in procs:
        try:
            rows.append((p.cpu_percent(None), p.pid, " ".join(p.info["cmdline"] or [])[:140]))
        except psutil.Error:
            pass
    return [f"{pct:5.0f}% pid {pid}: {cmd}" for pct, pid, cmd in sorted(rows, reverse=True)[:n]]


def short_tmp() -> Path:
    """AF_UNIX paths are limited to 107 bytes; pytest's tmp_path can be longer."""
    return Path(tempfile.mkdtemp(prefix="ey", dir="/tmp"))


def bench_home() -> Path:
    """A fresh state directory for a benchmark, made this process's EYAS_HOME (its socket's
    runtime dir inside it), so that the CLI and the daemons it starts use it."""
    home = short_tmp()
    os.environ.update(EYAS_HOME=str(home), XDG_RUNTIME_DIR=str(home / "rt"))
    return home


@contextlib.contextmanager
def private_daemon(grace: float = 3.0, extra_env: dict | None = None):
    """A real daemon on a private state directory for a module's tests (EYAS_HOME and
    XDG_RUNTIME_DIR set while it runs); its directory is removed afterwards unless
    EYAS_TEST_KEEP_HOME is set (to read the daemon's files after a failure)."""
    home = short_tmp()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EYAS_HOME", str(home))
        mp.setenv("XDG_RUNTIME_DIR", str(home / "rt"))
        d = Daemon(home, grace=grace, extra_env=extra_env)
        try:
            yield d.start()
        finally:
            d.cleanup()
            if not os.environ.get("EYAS_TEST_KEEP_HOME"):
                shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def daemon(monkeypatch):
    """A real daemon on a private state directory; torn down with all its ranks."""
    home = short_tmp()
    monkeypatch.setenv("EYAS_HOME", str(home))
    # It must exist to be used (a missing one means "logged out": /tmp is used instead).
    (home / "rt").mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(home / "rt"))
    d = Daemon(home).start()
    try:
        yield d
    finally:
        d.cleanup()
        shutil.rmtree(home, ignore_errors=True)
