"""Start a rank as the daemon does, without a daemon: an attempt dir, the rank log opened O_APPEND, the contract's environment, and the rank monitor as a new session's leader."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from eyas.daemon.progressfile import read_new

DEADLINE = 60.0  # generous: a loaded 2-core machine starts Pythons slowly


def wait_for(predicate, what: str, timeout: float = DEADLINE):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@dataclass
class Rank:
    proc: subprocess.Popen
    attempt_dir: Path
    output_dir: Path
    rank: int

    def file(self, suffix: str) -> Path:
        return self.attempt_dir / f"rank-{self.rank}.{suffix}"

    def json(self, suffix: str) -> dict:
        return json.loads(self.file(suffix).read_text())

    def log(self) -> str:
        return self.file("log").read_text()

    def progress(self) -> list[dict]:
        records, _, corrupt = read_new(self.file("progress.jsonl"), 0)
        assert corrupt == 0
        return records

    def wait(self) -> int:
        return self.proc.wait(timeout=DEADLINE)

    def wait_log(self, text: str) -> None:
        wait_for(lambda: self.file("log").exists() and text in self.log(), f"{text!r} in the log")

    def proc_json(self) -> dict:
        wait_for(lambda: self.file("proc.json").exists(), "rank proc.json")
        return self.json("proc.json")


@pytest.fixture
def start_rank(tmp_path):
    started: list[Rank] = []

    def start(
        options: dict | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        attempt: int = 1,
        stage: str = "selftest",
        preexec_fn=None,
        env: dict[str, str] | None = None,
    ) -> Rank:
        attempt_dir = tmp_path / "runs" / "7" / stage / f"attempt-{attempt}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        output_dir = tmp_path / "out"
        config = tmp_path / f"config-{attempt}.json"
        config.write_text(json.dumps({"stages": {stage: {"options": options or {}}}}))
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29511",
            "EYAS_RUN_ID": "7",
            "EYAS_STAGE": stage,
            "EYAS_ATTEMPT": str(attempt),
            "EYAS_ATTEMPT_DIR": str(attempt_dir),
            "EYAS_OUTPUT_DIR": str(output_dir),
            "EYAS_CONFIG": str(config),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        log_fd = os.open(attempt_dir / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "eyas.workers.runtime.monitor"],
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                env=env,
                start_new_session=True,
                preexec_fn=preexec_fn,
            )
        finally:
            os.close(log_fd)
        started.append(Rank(proc, attempt_dir, output_dir, rank))
        return started[-1]

    yield start
    for r in started:  # a failed test must not leave a rank group behind
        try:
            os.killpg(r.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        r.proc.wait(timeout=DEADLINE)
