"""No silent hangs, end to end: the straggler bound, the default stall watchdog and native stacks,
against a real daemon and real rank processes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from daemon_harness import Daemon, daemon, selftest_toml, short_tmp, wait_for  # noqa: F401 (fixture)

from eyas.daemon import stall
from eyas.state import specs

# Frames py-spy --native prints for a thread blocked in a lock, a join or a sleep.
NATIVE_FRAME = re.compile(
    r"pthread|PyThread_acquire_lock|lock_PyThread|futex|clock_nanosleep|time_sleep|"
    r"sem_wait|__lll_lock_wait|std::condition_variable|::wait"
)
SLACK = 6.0  # seconds past a bound: the 1 Hz watchdog, the stacks, the teardown, a loaded machine


def _attempts(run: dict, stage: str = "selftest") -> list[dict]:
    return {s["name"]: s for s in run["stages"]}[stage]["attempt_list"]


def _exit_time(attempt: dict, rank: int) -> float:
    return json.loads((Path(attempt["dir"]) / f"rank-{rank}.exit.json").read_text())["time"]


@pytest.fixture
def finalizing_daemon(monkeypatch):
    """A daemon whose ranks finalise the interpreter normally (EYAS_RANK_FINALIZE=1), as a
    user debugging an exit would run them: a rank can then hang after writing done.json."""
    home = short_tmp()
    monkeypatch.setenv("EYAS_HOME", str(home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(home / "rt"))
    d = Daemon(home, extra_env={"EYAS_RANK_FINALIZE": "1"}).start()
    try:
        yield d
    finally:
        d.cleanup()
        shutil.rmtree(home, ignore_errors=True)


def test_a_rank_alive_after_its_stage_returned_is_a_straggler_with_its_native_stacks(finalizing_daemon):
    d = finalizing_daemon
    run_id = d.submit(
        selftest_toml("linger", ranks=2, max_restarts=1, exit_timeout=3, options={"steps": 3, "linger_thread": True})
    )
    run = d.wait_run(run_id, timeout=90)
    first, second = _attempts(run)  # max_restarts = 1: one restart, which lingers too
    assert (run["state"], first["state"], second["state"]) == ("failed", "failed", "failed")
    for attempt in (first, second):
        done = json.loads((Path(attempt["dir"]) / "rank-0.done.json").read_text())
        assert done["exit_code"] == 0
        took = attempt["ended_at"] - done["time"]
        print(f"straggler after done.json recorded {took:.1f} s after it (exit_timeout 3)")
        assert 3 <= took <= 3 + SLACK, took
        root = attempt["root_cause"]
        pid = next(r["pid"] for r in attempt["ranks"] if r["rank"] == root["rank"])
        assert (root["type"], root["source"], root["pid"]) == ("Straggler", "straggler", pid)
        assert root["message"] == (
            f"rank {root['rank']} did not exit 3 s after its stage function returned "
            "(stages.selftest.exit_timeout = 3); its stacks follow"
        )
        tb = root["traceback"]
        table, tb = tb.split("\n\n", 1)  # every live process and its state first
        assert table.startswith("the group's processes when it was found stuck:\n") and f"(pid {pid}): " in table, table
        assert tb.startswith(f"rank {root['rank']} (pid {pid}):\nstate: "), tb
        assert "native stacks (py-spy dump --native):" in tb and NATIVE_FRAME.search(tb), tb
        assert "threading.py" in tb, tb  # the Python frames: the main thread joining the lingering one
    assert run["stages"][0]["restarts"] == 1


def test_a_rank_alive_after_its_peers_finished_is_a_straggler(daemon):
    run_id = daemon.submit(
        selftest_toml("at-end", ranks=2, exit_timeout=3, options={"steps": 3, "hang_at_end": True, "fail_rank": 0})
    )
    run = daemon.wait_run(run_id, timeout=60)
    (attempt,) = _attempts(run)
    took = attempt["ended_at"] - _exit_time(attempt, 1)
    print(f"straggler after peers recorded {took:.1f} s after rank 1 exited (exit_timeout 3)")
    assert 3 <= took <= 3 + SLACK, took
    root = attempt["root_cause"]
    assert (root["type"], root["rank"]) == ("Straggler", 0)
    assert root["message"] == (
        "rank 0 did not exit 3 s after its peers finished (stages.selftest.exit_timeout = 3); its stacks follow"
    )
    assert 'selftest.py", line' in root["traceback"] and NATIVE_FRAME.search(root["traceback"])
    assert [r["state"] for r in attempt["ranks"]] == ["killed", "exited"]
    assert attempt["reason"] == "Straggler: " + root["message"]


def test_the_gloo_teardown_deadlock_is_named_by_eyas_errors(daemon):
    run_id = daemon.submit(
        selftest_toml("gloo-naive", ranks=2, exit_timeout=5, options={"steps": 2, "gloo_teardown": "naive"})
    )
    run = daemon.wait_run(run_id, timeout=180)
    (attempt,) = _attempts(run)
    root = attempt["root_cause"]
    assert (root["type"], root["rank"]) == ("Straggler", 0), root
    out = daemon.cli("errors", run_id)
    assert out.returncode == 0, out.stderr
    assert "Straggler: rank 0 did not exit 5 s after" in out.stdout
    assert "~ProcessGroupGloo" in out.stdout, out.stdout

    run_id = daemon.submit(
        selftest_toml("gloo-safe", ranks=2, exit_timeout=5, options={"steps": 2, "gloo_teardown": "safe"}), "safe.toml"
    )
    assert daemon.wait_run(run_id, timeout=180)["state"] == "succeeded"


def test_the_watchdog_is_on_by_default_and_heartbeats_keep_a_stage_alive(daemon):
    default = specs.STAGES["selftest"].stall_timeout
    run_id = daemon.submit(
        selftest_toml(
            "quiet",
            ranks=2,
            stall_timeout=None,
            options={"steps": 5, "fail": "hang", "fail_rank": -1, "fail_at_step": 1},
        )
    )
    run = daemon.wait_run(run_id, timeout=default + 60)
    (attempt,) = _attempts(run)
    root = attempt["root_cause"]
    assert root["type"] == "Stalled"
    assert f"(stages.selftest.stall_timeout = {default:g})" in root["message"]
    assert NATIVE_FRAME.search(root["traceback"]) and " in _fail\n" in root["traceback"]
    quiet = float(re.search(r"for (\d+) s", root["message"]).group(1))
    print(
        f"default stall found after {quiet:g} s of quiet, attempt over {attempt['duration']:.1f} s after "
        f"it started (stall_timeout {default:g})"
    )
    assert default <= quiet <= default + 3  # checked at 1 Hz
    assert attempt["duration"] <= default + SLACK + 10  # start-up and the first steps included

    run_id = daemon.submit(
        selftest_toml("beats", ranks=1, stall_timeout=None, options={"steps": 1, "heartbeat_for": default + 5}),
        "beats.toml",
    )
    run = daemon.wait_run(run_id, timeout=default + 60)
    assert run["state"] == "succeeded", run
    assert _attempts(run)[0]["duration"] > default


def test_a_stall_names_the_last_heartbeat(tmp_path):
    (tmp_path / "rank-0.progress.jsonl").write_text(
        '{"time": 100.0, "samples": 1}\n{"time": 110.0, "heartbeat": "load weights"}\n{"time": 111.0, "samples": 2}\n'
    )
    (tmp_path / "rank-1.progress.jsonl").write_text('{"time": 105.0, "heartbeat": "engine start"}\n')

    class Group:
        dir, stage, stall_timeout = tmp_path, "extract", 600.0
        stuck = {
            "kind": "stall",
            "time": 720.0,
            "quiet": 609.0,
            "heartbeat": stall.last_heartbeat(tmp_path),
            "asked": [],
        }

    rec = stall.error_record(Group, "host")
    assert rec.message == (
        "no rank wrote a log line or progress, and no phase's evidence moved, for 609 s "
        "(stages.extract.stall_timeout = 600); rank 0 was in its phase 'load weights' "
        "(its last heartbeat 610 s before); the live ranks' stacks follow"
    )


def test_eyas_stacks_prints_native_frames_or_says_why_not(daemon, monkeypatch):
    run_id = daemon.submit(selftest_toml("hung", ranks=1, options={"fail": "hang"}))
    log = Path(wait_for(lambda: (r := daemon.ranks(run_id)) and r[0]["pid"] and r[0]["log_path"], 30))
    wait_for(lambda: log.exists() and "hanging" in log.read_text(), 60, what="the rank to hang")
    out = daemon.cli("stacks", run_id)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Current thread 0x" in out.stdout  # faulthandler's Python stacks
    assert "native stacks (py-spy dump --native):" in out.stdout  # then py-spy's
    assert "clock_nanosleep" in out.stdout or "time_sleep" in out.stdout, out.stdout
    daemon.cli("stop", run_id)
    daemon.wait_run(run_id)

    # Without py-spy, one line says so and the Python stacks are still there.
    daemon.stop()
    d = Daemon(daemon.home, extra_env={"EYAS_PY_SPY": str(daemon.home / "no-py-spy")}).start()
    try:
        run_id = d.submit(selftest_toml("hung2", ranks=1, options={"fail": "hang"}), "hung2.toml")
        log = Path(wait_for(lambda: (r := d.ranks(run_id)) and r[0]["pid"] and r[0]["log_path"], 30))
        wait_for(lambda: log.exists() and "hanging" in log.read_text(), 60, what="the rank to hang")
        out = d.cli("stacks", run_id)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "Current thread 0x" in out.stdout
        assert f"no native stacks: cannot run {daemon.home / 'no-py-spy'}: No such file or directory" in out.stdout
    finally:
        d.cleanup()


def test_the_straggler_rule_counts_from_done_json_or_from_the_last_peer(tmp_path):
    from eyas.daemon import straggler, watchdog
    from eyas.daemon.group import Group
    from eyas.daemon.ranks import Rank, RankExit

    group = Group(1, "selftest", 1, 1, tmp_path, 2, [], 0)
    group.ranks = [Rank(r, tmp_path / f"rank-{r}.log", 0, None, pid=100 + r) for r in range(2)]
    group.exit_timeout = 60.0
    assert straggler.check(group, 10_000.0) is None  # both still working
    (tmp_path / "rank-0.done.json").write_text(json.dumps({"pid": 100, "time": 100.0, "exit_code": 0}))
    assert straggler.check(group, 159.0) is None
    assert straggler.check(group, 160.0) == {
        "kind": "straggler",
        "time": 160.0,
        "rank": 0,
        "pid": 100,
        "after": "its stage function returned",
        "processes": "",  # none sampled here
    }
    (tmp_path / "rank-0.done.json").unlink()
    group.ranks[1].exit = RankExit(1, 101, 0, None, 200.0)
    assert straggler.check(group, 259.0) is None
    assert straggler.check(group, 260.0)["after"] == "its peers finished"
    group.ranks[1].exit = RankExit(1, 101, 3, None, 200.0)  # a failed peer is a failure, not a straggler's cue
    assert straggler.check(group, 10_000.0) is None
    group.ranks[1].exit = RankExit(1, 101, 0, None, 200.0)
    group.exit_timeout, group.stall_timeout = 0.0, 0.0  # both bounds off: nothing is ever stuck
    assert watchdog.check([group], 10_000.0) == []


async def test_a_vllm_tp_worker_gets_native_stacks_though_it_has_no_python_dump(tmp_path):
    """A TP worker writes into its driver's log, so it is never signalled for faulthandler's
    dump; py-spy reads it from outside instead, Python frames included."""
    import subprocess
    import sys

    import psutil

    from eyas.daemon import stacks
    from eyas.daemon.ranks import Rank
    from eyas.wire.stacks import report

    code = "import time\ndef engine_step():\n    time.sleep(60)\nprint('up', flush=True)\nengine_step()\n"
    worker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline() == "up\n"
        rank = Rank(
            3,
            tmp_path / "tp-1.log",
            0,
            None,
            None,
            worker.pid,
            psutil.Process(worker.pid).create_time(),
            role="tp-worker",
            tp_rank=1,
        )
        (entry,) = await stacks.collect([rank], python_wait=0.1)
        text = report([entry])
    finally:
        worker.kill()
        worker.wait()
    assert text.startswith(f"TP worker 1 (pid {worker.pid}):\nno Python stacks: a vLLM TP worker writes")
    assert "native stacks (py-spy dump --native):" in text
    assert "engine_step" in text and "sleep" in text  # the Python frame and the native call under it
