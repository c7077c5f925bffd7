"""`eyas logs`: rank logs read from the attempt directories the store records, merged by time."""

from __future__ import annotations

import calendar
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eyas.cli.logs import line_time
from eyas.state import paths, store

START = calendar.timegm((2026, 12, 2, 13, 5, 0))
ESC = "\x1b"

RANK0 = (
    "starting rank 0\n"
    "2026-12-02 13:05:01,100 INFO train: step 1\n"
    "2026-12-02 13:05:03,000 INFO train: step 2\n"
    "Traceback (most recent call last):\n"
    '  File "x.py", line 1, in <module>\n'
    "RuntimeError\n"
)
RANK1 = (
    "starting rank 1\n"
    "(Worker pid=7) INFO 12-02 13:05:02 [gpu_worker.py:12] loaded\n"
    "2026-12-02T13:05:03.000 rank 1 step 2\n"
    f"{ESC}[32mINFO{ESC}[0m 12-02 13:05:04 [x.py:1] coloured\n"
    "progress 10%\r progress 100%\n"
    "left without a newline"
)
RANK10 = "2026-12-02 13:05:00,500 INFO rank 10 first\n2026-12-02 13:05:03,000 INFO rank 10 ties with ranks 0 and 1\n"

MERGED = [
    "[r0] starting rank 0",
    "[r1] starting rank 1",
    "[r10] 2026-12-02 13:05:00,500 INFO rank 10 first",
    "[r0] 2026-12-02 13:05:01,100 INFO train: step 1",
    "[r1] (Worker pid=7) INFO 12-02 13:05:02 [gpu_worker.py:12] loaded",
    "[r0] 2026-12-02 13:05:03,000 INFO train: step 2",
    "[r0] Traceback (most recent call last):",
    '[r0]   File "x.py", line 1, in <module>',
    "[r0] RuntimeError",
    "[r1] 2026-12-02T13:05:03.000 rank 1 step 2",
    "[r10] 2026-12-02 13:05:03,000 INFO rank 10 ties with ranks 0 and 1",
    f"[r1] {ESC}[32mINFO{ESC}[0m 12-02 13:05:04 [x.py:1] coloured",
    "[r1] progress 10%\r progress 100%",
    "[r1] left without a newline",
]


def attempt(db, home, run_id, stage, files: dict[int, str], now=START, world_size=2):
    number = (store.stage_row(db, run_id, stage)["attempts"] or 0) + 1
    d = paths.attempt_dir(run_id, stage, number, home)
    d.mkdir(parents=True)
    for rank, text in files.items():
        (d / f"rank-{rank}.log").write_text(text)
    aid, _ = store.new_attempt(db, run_id, stage, dir=str(d), world_size=world_size, now=now)
    return aid, d


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    h = tmp_path_factory.mktemp("home")
    db = store.open_writer(paths.db_path(h))
    r = store.create_run(
        db, name="logs", model="m", stages=[{"name": "prepare"}, {"name": "train"}, {"name": "vocab"}], now=START - 60
    )
    store.move_run(db, r, "running", "started", now=START - 60)
    store.move_stage(db, r, "prepare", "running", "started", now=START - 60)
    a, _ = attempt(db, h, r, "prepare", {0: "prepare says hi\n"}, now=START - 60, world_size=1)
    store.move_attempt(db, a, "succeeded", "ok", now=START - 30)
    store.move_stage(db, r, "prepare", "succeeded", "ok", now=START - 30)
    store.move_stage(db, r, "train", "running", "started", now=START - 30)
    a, _ = attempt(db, h, r, "train", {0: "attempt one, rank 0\n", 1: "attempt one, rank 1\n"}, now=START - 30)
    store.move_attempt(db, a, "failed", "rank 1 failed", now=START - 5)
    attempt(db, h, r, "train", {0: RANK0, 1: RANK1, 10: RANK10})
    db.conn.close()
    return h


def test_merged_by_time(home, eyas_cli):
    p = eyas_cli(home, "logs", "1")  # default: the current stage (train), its latest attempt
    # Which stage that is goes to stderr, so that stdout stays the log's lines.
    note = "eyas logs: showing train, the stage running now; --stage NAME for another (prepare, vocab)\n"
    assert (p.returncode, p.stderr) == (0, note)
    assert p.stdout.split("\n")[:-1] == MERGED


def test_a_default_stage_is_named_a_chosen_one_is_not(tmp_path, eyas_cli):
    db = store.open_writer(paths.db_path(tmp_path))
    r = store.create_run(db, name="done", model="m", stages=[{"name": "prepare"}, {"name": "train"}], now=START)
    store.move_run(db, r, "running", "started", now=START)
    for stage in ("prepare", "train"):
        store.move_stage(db, r, stage, "running", "started", now=START)
        a, _ = attempt(db, tmp_path, r, stage, {0: f"{stage} line\n"}, world_size=1)
        store.move_attempt(db, a, "succeeded", "ok", now=START + 1)
        store.move_stage(db, r, stage, "succeeded", "ok", now=START + 1)
    store.move_run(db, r, "succeeded", "ok", now=START + 2)
    db.conn.close()
    p = eyas_cli(tmp_path, "logs", r)
    assert (p.returncode, p.stdout) == (0, "[r0] train line\n")
    assert p.stderr == "eyas logs: showing train, the last stage that ran; --stage NAME for another (prepare)\n"
    p = eyas_cli(tmp_path, "logs", r, "--stage", "prepare")
    assert (p.returncode, p.stdout, p.stderr) == (0, "[r0] prepare line\n", "")


def test_one_rank_verbatim(home, eyas_cli):
    p = eyas_cli(home, "logs", "1", "--rank", "1", "--stage", "train")
    assert (p.returncode, p.stdout, p.stderr) == (0, RANK1 + "\n", "")


def test_attempt_and_stage(home, eyas_cli):
    assert (
        eyas_cli(home, "logs", "1", "--attempt", "1").stdout == "[r0] attempt one, rank 0\n[r1] attempt one, rank 1\n"
    )
    assert eyas_cli(home, "logs", "1", "--stage", "prepare").stdout == "[r0] prepare says hi\n"


def test_grep(home, eyas_cli):
    p = eyas_cli(home, "logs", "1", "--grep", r"step \d")
    assert p.stdout.splitlines() == [
        "[r0] 2026-12-02 13:05:01,100 INFO train: step 1",
        "[r0] 2026-12-02 13:05:03,000 INFO train: step 2",
        "[r1] 2026-12-02T13:05:03.000 rank 1 step 2",
    ]
    assert eyas_cli(home, "logs", "1", "--rank", "0", "--grep", "^Run").stdout == "RuntimeError\n"


@pytest.mark.parametrize(
    "args, code, message",
    [
        (
            ["--grep", "step ("],
            2,
            "eyas logs: --grep 'step (': not a regular expression (missing ), unterminated subpattern at "
            "position 5); escape special characters\n",
        ),
        (["--stage", "nope"], 1, "eyas logs: run 1 has no stage 'nope' (its stages: prepare, train, vocab)\n"),
        (["--stage", "vocab"], 1, "eyas logs: stage vocab of run 1 has not started yet, so it has no logs\n"),
        (["--attempt", "3"], 1, "eyas logs: stage train of run 1 has no attempt 3 (its attempts: 1, 2)\n"),
        (["--rank", "4"], 1, "eyas logs: no log for rank 4 in {dir} (train attempt 2)\n"),
    ],
)
def test_bad_input(home, eyas_cli, args, code, message):
    p = eyas_cli(home, "logs", "1", *args)
    expected = message.format(dir=paths.attempt_dir(1, "train", 2, home))
    assert (p.returncode, p.stdout, p.stderr) == (code, "", expected)


def test_line_time_formats():
    start = (2026, 12, 31)
    assert line_time("2026-12-02 13:05:01,123 INFO x", start) == "2026-12-02 13:05:01.123000"
    assert line_time("[2026-12-02T13:05:01.5] x", start) == "2026-12-02 13:05:01.500000"
    assert line_time("2026-12-02 13:05:01 x", start) == "2026-12-02 13:05:01.000000"
    assert line_time("(EngineCore pid=9) WARNING 12-31 23:59:59 [a.py:3] x", start) == "2026-12-31 23:59:59.000000"
    # vLLM writes no year: a month-day before the attempt's start is the next year.
    assert line_time("INFO 01-01 00:00:01 [a.py:3] x", start) == "2027-01-01 00:00:01.000000"
    assert line_time(f"{ESC}[1;32mERROR{ESC}[0m 12-02 13:05:01.25 x", (2026, 1, 1)) == "2026-12-02 13:05:01.250000"
    assert line_time("no time here", start) is None
    assert line_time("INFO: 12-02 13:05:01", start) is None  # not vLLM's shape
    # A date deep inside a message is not the line's time.
    assert line_time("x" * 100 + " 2026-12-02 13:05:01", start) is None


class Reader:
    """Collect a subprocess's stdout lines in a thread, so the test can wait with a deadline."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: queue.Queue[str] = queue.Queue()
        self.thread = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True)
        self.thread.start()

    def _pump(self, stream):
        for line in stream:
            self.lines.put(line.rstrip("\n"))

    def take(self, n: int, timeout: float = 30) -> list[str]:
        deadline = time.monotonic() + timeout
        got = []
        while len(got) < n:
            try:
                got.append(self.lines.get(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"wanted {n} lines within {timeout}s, got {got}") from None
        return got


def follow(home: Path, *args) -> tuple[subprocess.Popen, Reader]:
    env = {**os.environ, "TZ": "UTC"}
    env.pop("EYAS_HOME", None)
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("eyas")), "--home", str(home), "logs", *map(str, args), "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    return proc, Reader(proc)


def test_follow_appends_new_ranks_new_attempt_then_stops(tmp_path):
    db = store.open_writer(paths.db_path(tmp_path))
    r = store.create_run(db, name="f", model="m", stages=[{"name": "train"}], now=START)
    store.move_run(db, r, "running", "started", now=START)
    store.move_stage(db, r, "train", "running", "started", now=START)
    a1, d1 = attempt(db, tmp_path, r, "train", {0: "2026-12-02 13:05:01,000 one\n"})
    proc, out = follow(tmp_path, r)
    try:
        assert out.take(1) == ["[r0] 2026-12-02 13:05:01,000 one"]
        with open(d1 / "rank-0.log", "a") as f:
            f.write("2026-12-02 13:05:02,000 two\nhalf a li")
            f.flush()
            assert out.take(1) == ["[r0] 2026-12-02 13:05:02,000 two"]
            f.write("ne, finished\n")
        assert out.take(1) == ["[r0] half a line, finished"]
        (d1 / "rank-1.log").write_text("2026-12-02 13:05:03,000 rank 1 arrives\n")
        assert out.take(1) == ["[r1] 2026-12-02 13:05:03,000 rank 1 arrives"]

        # The attempt fails and the stage gets another: the follower says so and switches.
        store.move_attempt(db, a1, "failed", "rank 0 failed", now=START + 10)
        a2, d2 = attempt(db, tmp_path, r, "train", {0: "2026-12-02 13:06:00,000 second attempt\n"}, now=START + 20)
        assert out.take(2) == [
            "--- train attempt 2 started; following it ---",
            "[r0] 2026-12-02 13:06:00,000 second attempt",
        ]

        # Attempt and stage end, the files go quiet: it stops by itself.
        with open(d2 / "rank-0.log", "a") as f:
            f.write("2026-12-02 13:06:01,000 done")  # no newline: printed when it stops
        store.move_attempt(db, a2, "succeeded", "ok", now=START + 30)
        store.move_stage(db, r, "train", "succeeded", "ok", now=START + 30)
        assert proc.wait(timeout=30) == 0
        assert out.take(1) == ["[r0] 2026-12-02 13:06:01,000 done"]
        assert proc.stderr.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_follow_one_rank_until_interrupted(tmp_path):
    db = store.open_writer(paths.db_path(tmp_path))
    r = store.create_run(db, name="f", model="m", stages=[{"name": "train"}], now=START)
    store.move_run(db, r, "running", "started", now=START)
    store.move_stage(db, r, "train", "running", "started", now=START)
    _, d = attempt(db, tmp_path, r, "train", {0: "zero\n", 1: "one\n"})
    proc, out = follow(tmp_path, r, "--rank", "1", "--grep", "keep")
    try:
        with open(d / "rank-1.log", "a") as f:
            f.write("drop this\nkeep this\n")
        with open(d / "rank-0.log", "a") as f:
            f.write("keep, but rank 0\n")
        assert out.take(1) == ["keep this"]
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=30) == 130
        out.thread.join(10)
        assert out.lines.empty()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
