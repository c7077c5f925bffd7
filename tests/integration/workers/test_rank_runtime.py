"""The worker side of the rank contract, with real processes and no daemon.

`start_rank` does what the daemon does: an attempt dir, the rank log opened O_APPEND, the
contract's environment, and `python -m eyas.workers.runtime.monitor` as a new session's leader.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import psutil
import pytest
from rank_harness import DEADLINE, Rank, start_rank, wait_for  # noqa: F401 (start_rank: fixture)

from eyas.daemon.progressfile import read_new
from eyas.workers.runtime import atomic
from eyas.workers.runtime.progress import ProgressWriter
from eyas.workers.runtime.rank import LOG_FORMAT


def gone(pid: int) -> bool:
    """Dead, or a zombie that init has not reaped yet (it can no longer run)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def exit_fields(record: dict) -> dict:
    assert isinstance(record.pop("time"), float)
    return record


# --- the monitor and the runtime -----------------------------------------------------------


def test_success_records_pids_progress_exit_and_result(start_rank):
    r = start_rank({"steps": 10, "step_time": 0.1})
    proc = r.proc_json()
    assert set(proc) == {"monitor_pid", "monitor_create_time", "pid", "create_time", "host", "slurm_job"}
    assert (proc["host"], proc["slurm_job"]) == (socket.gethostname(), None)  # a local rank, no job
    assert proc["monitor_pid"] == r.proc.pid
    # Checked while both run: this is how the daemon will recognise its ranks after a restart.
    assert psutil.Process(proc["pid"]).create_time() == proc["create_time"]
    assert psutil.Process(proc["monitor_pid"]).create_time() == proc["monitor_create_time"]
    assert psutil.Process(proc["pid"]).ppid() == proc["monitor_pid"]
    assert os.getpgid(proc["pid"]) == proc["monitor_pid"]  # same process group as the monitor
    assert r.wait() == 0

    assert exit_fields(r.json("exit.json")) == {
        "pid": proc["pid"],
        "exit_code": 0,
        "signal": None,
        "signal_name": None,
        "core_dumped": False,
    }
    assert not r.file("error.json").exists()
    last = r.progress()[-1]
    assert (last["samples"], last["samples_total"], last["tokens"], last["tokens_total"]) == (10, 10, 1000, 1000)
    assert last["loss"] == pytest.approx(0.1)
    result = json.loads((r.output_dir / "selftest" / "rank-0.result.json").read_text())
    assert result == {"steps_run_this_attempt": 10, "steps_total": 10}
    log = r.log()
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO eyas\.selftest: step 10/10$", log, re.M)
    assert log.count("eyas.selftest: step ") == 10
    assert "eyas.runtime: rank 0/1: stage selftest, attempt 1" in log
    # Atomic writes left no temp files, and the records' reserved blocks were given back.
    assert sorted(p.name for p in r.attempt_dir.glob(".*")) == []


@pytest.mark.parametrize(
    "mode, type_, message, code",
    [
        ("raise-empty", "RuntimeError", "", 1),
        ("raise", "RuntimeError", "selftest failure", 1),
        ("exit", "SystemExit", "exit code 3", 3),
    ],
)
def test_exception_is_recorded_in_error_json(start_rank, mode, type_, message, code):
    r = start_rank(
        {"fail": mode, "fail_rank": 1, "fail_at_step": 2, "step_time": 0.01}, rank=1, world_size=2, attempt=2
    )
    assert r.wait() == code
    error = r.json("error.json")
    exit_ = exit_fields(r.json("exit.json"))
    assert exit_ == {"pid": error["pid"], "exit_code": code, "signal": None, "signal_name": None, "core_dumped": False}
    assert error["pid"] == r.json("proc.json")["pid"]
    assert (error["type"], error["message"]) == (type_, message)
    assert "selftest.py" in error["traceback"] and type_ in error["traceback"]
    assert (error["rank"], error["host"], error["stage"], error["attempt"]) == (1, socket.gethostname(), "selftest", 2)
    assert abs(datetime.datetime.fromisoformat(error["timestamp"]).timestamp() - error["time"]) < 1e-3
    assert error["traceback"] in r.log()  # the same traceback reaches the log
    # Steps before the failing one were done and reported.
    assert r.progress()[-1]["samples"] == 2


def test_unknown_stage_is_an_error(start_rank):
    r = start_rank(stage="nope")
    assert r.wait() == 1
    error = r.json("error.json")
    assert error["type"] == "LookupError"
    assert error["message"].startswith("unknown stage 'nope': use one of preflight, prepare, regenerate, extract")


def test_bad_selftest_option_names_the_fix(start_rank):
    r = start_rank({"fail": "explode"})
    assert r.wait() == 1
    error = r.json("error.json")
    assert (error["type"], error["message"]) == (
        "ValueError",
        "stages.selftest.options.fail: unknown value 'explode'; use one of: raise, raise-empty, exit, segfault, "
        "sigkill, children, hang, tp-worker",
    )


def test_sigkill_is_named_by_the_monitor(start_rank):
    r = start_rank({"fail": "sigkill", "step_time": 0.01})
    assert r.wait() == 128 + 9
    pid = r.json("proc.json")["pid"]
    assert exit_fields(r.json("exit.json")) == {
        "pid": pid,
        "exit_code": None,
        "signal": 9,
        "signal_name": "SIGKILL",
        "core_dumped": False,
    }
    assert not r.file("error.json").exists()
    assert f"eyas: rank 0 (pid {pid}) was killed by SIGKILL\n" in r.log()
    assert sorted(p.name for p in r.attempt_dir.glob(".*")) == []  # the killed rank's reserve is given back


def _no_core():
    # A segfault must not drop a core file into the test's working directory.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def test_segfault_leaves_a_stack_in_the_log(start_rank):
    r = start_rank({"fail": "segfault", "step_time": 0.01}, preexec_fn=_no_core)
    assert r.wait() == 128 + 11
    log = r.log()
    assert "Fatal Python error: Segmentation fault" in log
    stack = log.split("Fatal Python error: Segmentation fault", 1)[1]
    assert re.search(r'File ".*selftest\.py", line \d+ in _fail', stack)
    assert exit_fields(r.json("exit.json")) == {
        "pid": r.json("proc.json")["pid"],
        "exit_code": None,
        "signal": 11,
        "signal_name": "SIGSEGV",
        "core_dumped": False,
    }
    assert not r.file("error.json").exists()


def test_worker_killed_from_outside(start_rank):
    r = start_rank({"fail": "hang"})
    pid = r.proc_json()["pid"]
    r.wait_log("eyas.selftest: hanging")
    os.kill(pid, signal.SIGKILL)
    assert r.wait() == 137
    assert exit_fields(r.json("exit.json")) == {
        "pid": pid,
        "exit_code": None,
        "signal": 9,
        "signal_name": "SIGKILL",
        "core_dumped": False,
    }


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_to_the_monitor_is_forwarded(start_rank, sig):
    r = start_rank({"fail": "hang"})
    pid = r.proc_json()["pid"]
    r.wait_log("eyas.selftest: hanging")
    os.kill(r.proc.pid, sig)
    assert r.wait() == 128 + sig
    assert exit_fields(r.json("exit.json")) == {
        "pid": pid,
        "exit_code": None,
        "signal": int(sig),
        "signal_name": sig.name,
        "core_dumped": False,
    }
    assert f"eyas: rank 0 (pid {pid}) was killed by {sig.name}\n" in r.log()
    assert not psutil.pid_exists(pid)  # the monitor reaped it


def test_sigint_to_the_monitor_becomes_keyboardinterrupt(start_rank):
    r = start_rank({"fail": "hang"})
    r.wait_log("eyas.selftest: hanging")
    os.kill(r.proc.pid, signal.SIGINT)
    assert r.wait() == 1
    error = r.json("error.json")
    assert (error["type"], error["message"]) == ("KeyboardInterrupt", "")
    assert "selftest.py" in error["traceback"]
    assert exit_fields(r.json("exit.json"))["exit_code"] == 1


def test_process_group_kill_reaches_leftover_children(start_rank):
    r = start_rank({"fail": "children", "step_time": 0.01})
    assert r.wait() == 1
    assert r.json("error.json")["type"] == "RuntimeError"
    kids = r.json("children.json")
    pids = kids["children"] + kids["grandchildren"]
    assert len(kids["children"]) == 2 and len(kids["grandchildren"]) == 1
    # The rank is over, yet its processes live on, reparented, in the monitor's group.
    for pid in pids:
        assert not gone(pid), f"pid {pid} should still run"
        assert os.getpgid(pid) == r.proc.pid
    os.killpg(r.proc.pid, signal.SIGKILL)  # what the daemon does after a rank group ends
    for pid in pids:
        wait_for(lambda pid=pid: gone(pid), f"pid {pid} to die")


def test_resume_skips_steps_done_by_an_earlier_attempt(start_rank):
    options = {"steps": 10, "step_time": 0.01, "fail": "raise", "fail_at_step": 5, "fail_attempts": [1]}
    first = start_rank(options, attempt=1)
    assert first.wait() == 1
    assert first.json("error.json")["message"] == "selftest failure"
    assert "resuming" not in first.log()
    second = start_rank(options, attempt=2)
    assert second.wait() == 0
    assert "eyas.selftest: resuming at step 5\n" in second.log()
    assert second.log().count("eyas.selftest: step ") == 5
    result = json.loads((second.output_dir / "selftest" / "rank-0.result.json").read_text())
    assert result == {"steps_run_this_attempt": 5, "steps_total": 10}
    progress = second.progress()
    assert (progress[0]["samples"], progress[-1]["samples"]) == (5, 10)
    done = (second.output_dir / "selftest" / "rank-0.done").read_text().split()
    assert done == [str(n) for n in range(10)]


def test_flood_of_20000_lines_per_second_loses_nothing(start_rank):
    rate = 20_000
    ranks = [start_rank({"lines_per_sec": rate, "duration": 1.0}, rank=n, world_size=2) for n in (0, 1)]
    for r in ranks:
        assert r.wait() == 0
    for r in ranks:
        log = r.log()
        numbers = Counter(int(n) for n in re.findall(rf"^r{r.rank} line (\d+) @\d+\.\d+$", log, re.M))
        assert sorted(numbers) == list(range(rate)) and set(numbers.values()) == {1}
        assert f"eyas.selftest: wrote {rate} lines\n" in log
        progress = r.progress()
        assert progress[-1]["samples"] == 20  # 1 s in steps of 0.05 s
        # The rate was met, with a wide margin for a loaded machine.
        assert progress[-1]["time"] - progress[0]["time"] < 4.0


def test_workers_modules_stay_light():
    code = (
        "import sys, eyas.workers.runtime.monitor, eyas.workers.runtime.rank, eyas.workers.runtime.progress, "
        "eyas.workers.runtime.atomic, eyas.workers.stages.selftest; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'numpy', 'transformers', 'vllm', 'textual', 'eyas.daemon', 'eyas.tui'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "[]\n"


def test_log_format_starts_with_a_timestamp():
    assert LOG_FORMAT.startswith("%(asctime)s ")


# --- progress writer ------------------------------------------------------------


def test_progress_writer_throttles_but_never_loses_the_last_update(tmp_path):
    path = tmp_path / "p.jsonl"
    writer = ProgressWriter(path, min_interval=3600)
    assert writer.update(samples=0, samples_total=100, tokens=0, tokens_total=1000) is True  # totals set
    for n in range(1, 51):
        assert writer.update(samples=n, tokens=10 * n, loss=1.0 / n) is False
    assert writer.update(samples=50, samples_total=200) is True  # a total changed
    assert writer.update(samples=60, acc_0=0.5) is False
    writer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        assert isinstance(line.pop("time"), float)
    assert lines == [
        {"samples": 0, "samples_total": 100, "tokens": 0, "tokens_total": 1000},
        {"samples": 50, "samples_total": 200, "tokens": 500, "tokens_total": 1000, "loss": 0.02},
        {"samples": 60, "samples_total": 200, "tokens": 500, "tokens_total": 1000, "acc_0": 0.5},
    ]
    writer.close()  # nothing pending: nothing more written
    assert len(path.read_text().splitlines()) == 3


def test_progress_writer_writes_again_after_the_interval(tmp_path):
    path = tmp_path / "p.jsonl"
    with ProgressWriter(path, min_interval=0.05) as writer:
        writer.update(samples=1, samples_total=3)
        assert writer.update(samples=2) is False
        time.sleep(0.06)
        assert writer.update(samples=3) is True
    assert [json.loads(line)["samples"] for line in path.read_text().splitlines()] == [1, 3]


# --- atomic writes -------------------------------------------------------------------------


def test_atomic_write_replaces_whole_and_cleans_up_on_failure(tmp_path):
    target = tmp_path / "x.json"
    atomic.write_json(target, {"a": 1})
    atomic.write_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    with pytest.raises(RuntimeError, match="half way"):
        with atomic.atomic_path(target) as tmp:
            tmp.write_text("partial")
            raise RuntimeError("half way")
    assert json.loads(target.read_text()) == {"a": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]
    with atomic.atomic_path(tmp_path / "y.bin") as tmp:
        tmp.write_bytes(b"\x00\x01")  # as safetensors' save_file(tensors, tmp) would
    assert (tmp_path / "y.bin").read_bytes() == b"\x00\x01"


# --- the end of a rank ----------------------------------------------------------------------


def test_a_finished_rank_ends_at_once_despite_a_thread_that_never_ends(start_rank):
    r = start_rank({"steps": 2, "step_time": 0.01, "linger_thread": True})
    assert r.wait() == 0
    done, exit_ = r.json("done.json"), r.json("exit.json")
    assert set(done) == {"pid", "time", "exit_code"}
    assert (done["pid"], done["exit_code"]) == (exit_["pid"], 0)
    took = exit_["time"] - done["time"]
    print(f"rank ended {took:.3f} s after done.json")
    assert 0 <= took < 2.0, took
    log = r.log()
    assert "left a thread that never ends" in log and "eyas.runtime: rank done: exit code 0\n" in log


def test_eyas_rank_finalize_keeps_the_interpreter_exit_which_waits_for_the_thread(start_rank):
    r = start_rank({"steps": 2, "step_time": 0.01, "linger_thread": True}, env={"EYAS_RANK_FINALIZE": "1"})
    wait_for(lambda: r.file("done.json").exists(), "done.json")
    assert r.json("done.json")["exit_code"] == 0
    time.sleep(3.0)
    assert r.proc.poll() is None, "the rank ended though its non-daemon thread never does"
    assert not r.file("exit.json").exists()
    assert "finalising the interpreter (EYAS_RANK_FINALIZE=1)" in r.log()


def test_done_json_follows_error_json_on_failure(start_rank):
    r = start_rank({"fail": "exit", "step_time": 0.01, "linger_thread": True})
    assert r.wait() == 3
    error, done = r.json("error.json"), r.json("done.json")
    assert done["exit_code"] == 3 and done["pid"] == error["pid"]
    assert error["time"] <= done["time"] <= r.json("exit.json")["time"]


# --- heartbeats -------------------------------------------------------------------------------


def test_beating_writes_heartbeats_at_the_interval_and_stops(tmp_path):
    path = tmp_path / "p.jsonl"
    writer = ProgressWriter(path)
    writer.update(samples=1, samples_total=10, tokens=5, tokens_total=50)
    t0 = time.time()
    reads = iter(range(100))
    with writer.beating("load weights", every=0.2, kind="load", budget=90.5, evidence=lambda: {"read": next(reads)}):
        time.sleep(1.1)
    records = [r for r in read_new(path, 0)[0] if "heartbeat" in r]
    beats, end = records[:-1], records[-1]
    assert [set(b) for b in beats] == [{"time", "heartbeat", "phase"}] * len(beats)  # no counts
    assert {b["heartbeat"] for b in beats} == {"load weights"}
    assert 5 <= len(beats) <= 7, beats  # one at entry, then one every 0.2 s
    # The phase: its kind, start, budget and the evidence measured at each beat.
    since = beats[0]["phase"]["since"]
    assert t0 <= since <= beats[0]["time"]
    assert [b["phase"] for b in beats] == [
        {"kind": "load", "since": since, "budget": 90.5, "evidence": {"read": i}} for i in range(len(beats))
    ]
    assert set(end) == {"time", "heartbeat", "ended"} and (end["heartbeat"], end["ended"]) == ("load weights", True)
    gaps = [b["time"] - a["time"] for a, b in zip(beats, beats[1:])]
    assert all(0.15 < g < 0.6 for g in gaps), gaps
    size = path.stat().st_size
    time.sleep(0.5)
    assert path.stat().st_size == size  # stopped with the block
    assert not [t for t in threading.enumerate() if t.name.startswith("heartbeat-")]
    writer.close()


def test_a_silent_phase_writes_only_heartbeats(start_rank):
    r = start_rank({"steps": 1, "step_time": 0.01, "heartbeat_for": 2.5})
    assert r.wait() == 0
    records = r.progress()
    beats = [x for x in records if "heartbeat" in x]
    assert len(beats) >= 3 and all(set(b) == {"time", "heartbeat", "phase"} for b in beats[:-1])
    assert beats[-1]["ended"] is True and not set(beats[-1]) & {"samples", "tokens"}
    assert records[-1]["samples"] == 1
