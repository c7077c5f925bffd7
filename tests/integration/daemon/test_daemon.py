"""The daemon end to end: real daemon, real rank processes, real SQLite."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest
from daemon_harness import Daemon, daemon, selftest_toml, short_tmp, wait_for  # noqa: F401 (fixture)

from eyas.state import paths
from eyas.wire.client import Client, DaemonError


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _worker_pids(d: Daemon, run_id: int, n: int) -> list[int]:
    return wait_for(
        lambda: (pids := [r["pid"] for r in d.ranks(run_id)]) and len(pids) == n and all(pids) and pids,
        30,
        what="rank pids",
    )


def _root(run: dict, stage: str = "selftest") -> dict:
    return {s["name"]: s for s in run["stages"]}[stage]["attempt_list"][-1]["root_cause"]


def test_success_records_every_rank_and_metrics(daemon):
    run_id = daemon.submit(selftest_toml("ok", ranks=2, options={"steps": 30, "step_time": 0.05}))
    run = daemon.wait_run(run_id)
    assert run["state"] == "succeeded"
    (stage,) = run["stages"]
    assert (stage["state"], stage["attempts"]) == ("succeeded", 1)
    ranks = stage["attempt_list"][0]["ranks"]
    assert [(r["rank"], r["state"], r["exit_code"], r["signal"]) for r in ranks] == [
        (0, "exited", 0, None),
        (1, "exited", 0, None),
    ]
    db = daemon.reader()
    names = {row[0] for row in db.execute("select distinct name from metrics where run_id = ?", [run_id])}
    assert {"cpu_percent", "rss_bytes", "tokens", "samples", "tok_s"} <= names
    # Roll-ups for history: each rank's mean tok/s, summed for the stage and the run.
    rank_rates = [r["tok_s"] for r in ranks]
    assert all(rate and rate > 0 for rate in rank_rates)
    assert stage["tok_s"] == pytest.approx(sum(rank_rates))
    assert run["tok_s"] == pytest.approx(stage["tok_s"])
    # The last progress line of each rank was read after it exited: every token is counted.
    last = db.execute(
        "select max(value) from metrics where run_id = ? and name = 'tokens' and rank = 0", [run_id]
    ).fetchone()[0]
    assert last == 30 * 100
    # Every transition is an event with a reason.
    events = [
        (e["entity"], e["from_state"], e["to_state"])
        for e in db["events"].rows_where("run_id = ?", [run_id], order_by="id")
    ]
    assert events[0] == ("run", None, "pending")
    assert ("stage", "pending", "running") in events and ("stage", "running", "succeeded") in events
    assert events[-1] == ("run", "running", "succeeded")
    assert all(e["reason"] for e in db["events"].rows_where("run_id = ?", [run_id]))
    # The rank contract's environment reached the ranks.
    log = Path(ranks[1]["log_path"]).read_text()
    assert "r1" in log or "rank 1" in log


def test_empty_runtime_error_is_the_root_cause_with_type_rank_and_traceback(daemon):
    run_id = daemon.submit(
        selftest_toml(
            "empty",
            ranks=2,
            options={"steps": 200, "step_time": 0.05, "fail": "raise-empty", "fail_rank": 1, "fail_at_step": 2},
        )
    )
    run = daemon.wait_run(run_id)
    assert run["state"] == "failed"
    root = _root(run)
    assert (root["type"], root["message"], root["rank"], root["source"]) == ("RuntimeError", "", 1, "exception")
    assert 'raise RuntimeError("")' in root["traceback"]
    assert root["path"].endswith("rank-1.error.json")
    # Rank 0 was torn down by eyas, not counted as a failure of its own.
    ranks = {r["rank"]: r for r in daemon.ranks(run_id)}
    assert ranks[1]["state"] == "failed" and ranks[0]["state"] == "killed"
    out = daemon.cli("errors", run_id)
    assert out.returncode == 0 and "RuntimeError (empty message)" in out.stdout


def test_a_failed_stage_keeps_what_it_recorded_before_failing(daemon):
    """evaluate writes its figures, then fails on a lossless mismatch: the figures are kept."""
    run_id = daemon.submit(
        selftest_toml(
            "measured",
            ranks=1,
            options={"steps": 5, "step_time": 0.01, "fail": "raise", "fail_at_step": 3, "summary_on_fail": True},
        )
    )
    run = daemon.wait_run(run_id)
    stage = run["stages"][0]
    assert (run["state"], stage["state"]) == ("failed", "failed")
    assert stage["summary"] == {"failed_at_step": 3, "attempt": 1}
    assert _root(run)["type"] == "RuntimeError"


def test_sigkilled_rank_is_named_and_the_group_is_gone_within_two_seconds(daemon):
    run_id = daemon.submit(selftest_toml("kill", ranks=3, options={"steps": 2000, "step_time": 0.05}))
    pids = _worker_pids(daemon, run_id, 3)
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    wait_for(lambda: not any(_alive(p) for p in pids), 2.0, 0.01, "every rank to be gone")
    assert time.monotonic() - killed_at <= 2.0
    run = daemon.wait_run(run_id)
    root = _root(run)
    assert (root["type"], root["rank"], root["source"]) == ("SIGKILL", 1, "signal")
    assert "killed by SIGKILL (signal 9)" in root["message"]
    ranks = {r["rank"]: r for r in daemon.ranks(run_id)}
    assert (ranks[1]["signal"], ranks[1]["state"]) == (9, "failed")


def test_segfault_leaves_the_native_stack_in_the_log(daemon):
    run_id = daemon.submit(
        selftest_toml(
            "segv",
            ranks=2,
            options={"steps": 200, "step_time": 0.05, "fail": "segfault", "fail_rank": 0, "fail_at_step": 1},
        )
    )
    run = daemon.wait_run(run_id)
    root = _root(run)
    assert (root["type"], root["rank"]) == ("SIGSEGV", 0)
    assert "Fatal Python error: Segmentation fault" in root["traceback"]
    assert "selftest.py" in root["traceback"]
    rank0 = daemon.ranks(run_id)[0]
    assert rank0["signal"] == signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in Path(rank0["log_path"]).read_text()


def test_children_of_a_failed_rank_do_not_survive(daemon):
    run_id = daemon.submit(
        selftest_toml(
            "kids",
            ranks=2,
            options={"steps": 200, "step_time": 0.05, "fail": "children", "fail_rank": 1, "fail_at_step": 1},
        )
    )
    run = daemon.wait_run(run_id)
    assert run["state"] == "failed"
    attempt_dir = Path(run["stages"][0]["attempt_list"][0]["dir"])
    kids = json.loads((attempt_dir / "rank-1.children.json").read_text())
    spawned = kids["children"] + kids["grandchildren"]
    assert len(spawned) == 3
    wait_for(lambda: not any(_alive(p) for p in spawned), 5, what="the children to be gone")
    every = [r["pid"] for r in daemon.ranks(run_id)]
    assert not any(_alive(p) for p in every)


def test_daemon_killed_mid_stage_readopts_and_completes(daemon):
    run_id = daemon.submit(selftest_toml("adopt", ranks=2, options={"steps": 60, "step_time": 0.05}))
    pids = _worker_pids(daemon, run_id, 2)
    daemon.kill9()
    assert all(_alive(p) for p in pids), "ranks must not depend on the daemon"
    daemon.start()
    run = daemon.wait_run(run_id)
    assert run["state"] == "succeeded"
    (stage,) = run["stages"]
    assert stage["attempts"] == 1  # adopted, not restarted
    ranks = stage["attempt_list"][0]["ranks"]
    assert [(r["pid"], r["exit_code"], r["state"]) for r in ranks] == [(pids[0], 0, "exited"), (pids[1], 0, "exited")]
    db = daemon.reader()
    reasons = [e["reason"] for e in db["events"].rows_where("run_id = ?", [run_id])]
    assert "every rank exited 0" in reasons


def test_rank_that_died_while_the_daemon_was_down_is_settled(daemon):
    run_id = daemon.submit(selftest_toml("settle", ranks=2, options={"steps": 2000, "step_time": 0.05}))
    pids = _worker_pids(daemon, run_id, 2)
    daemon.kill9()
    os.kill(pids[0], signal.SIGKILL)
    wait_for(lambda: not _alive(pids[0]), 5)
    daemon.start()
    run = daemon.wait_run(run_id)
    assert run["state"] == "failed"
    root = _root(run)
    assert (root["type"], root["rank"]) == ("SIGKILL", 0)
    assert not any(_alive(p) for p in pids)


def test_retry_resumes_from_completed_work(daemon):
    run_id = daemon.submit(
        selftest_toml(
            "retry",
            ranks=2,
            options={
                "steps": 10,
                "step_time": 0.02,
                "fail": "raise",
                "fail_rank": 0,
                "fail_at_step": 6,
                "fail_attempts": [1],
            },
        )
    )
    assert daemon.wait_run(run_id)["state"] == "failed"
    out = daemon.cli("retry", run_id)
    assert out.returncode == 0, out.stderr
    run = daemon.wait_run(run_id, ("succeeded",))
    stage = run["stages"][0]
    assert stage["attempts"] == 2
    attempt2 = Path(stage["attempt_list"][1]["dir"])
    out_dir = Path(run["output_dir"]) / "selftest"
    result = json.loads((out_dir / "rank-0.result.json").read_text())
    # Rank 0 raises at step 6 and only it (were every rank to raise, rank 1 could do so first
    # on a loaded machine and the teardown stop rank 0 before its first step): it completed 6.
    resumed_at = 10 - result["steps_run_this_attempt"]
    assert resumed_at == 6, result
    assert f"resuming at step {resumed_at}" in (attempt2 / "rank-0.log").read_text()


def test_max_restarts_with_backoff_ends_failed(daemon):
    run_id = daemon.submit(
        selftest_toml(
            "flaky",
            ranks=1,
            max_restarts=2,
            backoff=0.2,
            options={"steps": 5, "step_time": 0.01, "fail": "raise", "fail_rank": 0},
        )
    )
    run = daemon.wait_run(run_id, timeout=60)
    assert run["state"] == "failed"
    attempts = run["stages"][0]["attempt_list"]
    assert [a["state"] for a in attempts] == ["failed", "failed", "failed"]
    # Backoff doubles: 0.2 s, then 0.4 s between attempts.
    gaps = [attempts[i + 1]["started_at"] - attempts[i]["ended_at"] for i in range(2)]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4


def test_stop_skip_resume_and_illegal_transitions(daemon):
    run_id = daemon.submit(selftest_toml("stop", ranks=2, options={"steps": 2000, "step_time": 0.05}))
    pids = _worker_pids(daemon, run_id, 2)
    out = daemon.cli("stop", run_id)
    assert out.returncode == 0, out.stderr
    run = daemon.wait_run(run_id)
    assert (run["state"], run["stages"][0]["state"]) == ("cancelled", "cancelled")
    assert run["stages"][0]["attempt_list"][0]["state"] == "cancelled"
    assert not any(_alive(p) for p in pids)

    out = daemon.cli("skip", run_id, "--stage", "selftest")
    assert out.returncode == 0, out.stderr
    out = daemon.cli("resume", run_id)
    assert out.returncode == 0, out.stderr
    assert daemon.wait_run(run_id, ("succeeded",))["stages"][0]["state"] == "skipped"

    # A finished run refuses, with the states it could have moved between.
    out = daemon.cli("retry", run_id, "--stage", "selftest")
    assert out.returncode == 1
    assert (
        out.stderr.strip()
        == f"eyas retry: run {run_id} is succeeded; it cannot become pending (from succeeded: none: it is final)"
    )
    out = daemon.cli("stop", run_id)
    assert out.returncode == 1
    assert (
        out.stderr.strip()
        == f"eyas stop: run {run_id} is succeeded; it cannot become cancelled (from succeeded: none: it is final)"
    )
    out = daemon.cli("skip", run_id, "--stage", "nope")
    assert out.returncode == 1 and "has no stage 'nope' (its stages: selftest)" in out.stderr


def test_stacks_of_a_hung_stage_are_printed_and_the_ranks_live_on(daemon):
    run_id = daemon.submit(selftest_toml("hang", ranks=2, options={"fail": "hang", "fail_rank": -1}))
    pids = _worker_pids(daemon, run_id, 2)
    logs = [Path(r["log_path"]) for r in daemon.ranks(run_id)]
    wait_for(lambda: all(p.exists() and "hanging" in p.read_text() for p in logs), 60, what="both ranks to hang")

    out = daemon.cli("stacks", run_id)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(f"run {run_id}: selftest attempt 1\n")
    blocks = out.stdout.split("\nrank ")[1:]
    assert [b.split(" ", 1)[0] for b in blocks] == ["0", "1"]
    for rank, (block, pid) in enumerate(zip(blocks, pids)):
        # Its state from /proc (how long in it, its CPU), then faulthandler's dump.
        head = f"{rank} (pid {pid}), also in {logs[rank]}:\nstate: "
        assert block.startswith(head) and "\n\nCurrent thread 0x" in block, block
        assert re.match(r"(sleeping|running)\b", block[len(head) :]), block
        # The hung frame itself: selftest's sleep loop, called from the runtime's entry.
        assert 'selftest.py", line' in block and " in _fail\n" in block, block
        assert "hanging" not in block  # only faulthandler's lines, not the log's other output
        assert 'runtime/rank.py", line' in block
    # The dump is in the logs too, and the ranks are still there, still hung.
    assert all("Current thread 0x" in p.read_text() for p in logs)
    assert all(_alive(p) for p in pids)
    assert daemon.run(run_id)["state"] == "running"

    # A stage that is not running has no stacks: said, with where the traceback is instead.
    assert daemon.cli("stop", run_id).returncode == 0
    daemon.wait_run(run_id)
    out = daemon.cli("stacks", run_id)
    assert out.returncode == 1
    assert out.stderr.strip() == (
        f"eyas stacks: run {run_id} has no running stage: only live ranks have "
        f"stacks (a failed rank's traceback: eyas errors {run_id})"
    )


def test_a_stage_that_goes_quiet_fails_as_stalled_with_the_stacks_and_restarts(daemon):
    # Rank 1 hangs in attempt 1 only; rank 0 finishes its steps and exits. Nothing is written
    # after that, so after stall_timeout the attempt fails, and the restart succeeds.
    run_id = daemon.submit(
        selftest_toml(
            "stall",
            ranks=2,
            max_restarts=1,
            stall_timeout=2,
            options={"steps": 5, "fail": "hang", "fail_rank": 1, "fail_attempts": [1]},
        )
    )
    run = daemon.wait_run(run_id, timeout=60)
    assert run["state"] == "succeeded", run
    first, second = run["stages"][0]["attempt_list"]
    assert (first["state"], second["state"]) == ("failed", "succeeded")
    assert run["stages"][0]["restarts"] == 1
    # Stall found 2-3 s after the last write (checked at 1 Hz), then 1.5 s for the stacks and
    # the teardown (SIGTERM; the hung rank ends at once).
    assert first["duration"] < 12, first
    root = first["root_cause"]
    pid = next(r["pid"] for r in first["ranks"] if r["rank"] == 1)
    assert (root["type"], root["rank"], root["pid"], root["source"]) == ("Stalled", 1, pid, "stall")
    assert re.fullmatch(
        r"no rank wrote a log line or progress, and no phase's evidence moved, for [23] s "
        r"\(stages\.selftest\.stall_timeout = 2\); the live ranks' stacks follow",
        root["message"],
    ), root["message"]
    # Every live process and its state first (rank 0 had exited: it is not there), then the stacks.
    table, stacks = root["traceback"].split("\n\n", 1)
    assert re.fullmatch(
        rf"the group's processes when it was found stuck:\n  rank 1 \(pid {pid}\): sleeping for \d+ s, cpu [\d.]+ s  \[.*\]"
        rf"\n  rank 1's monitor \(pid \d+\): sleeping for \d+ s, cpu [\d.]+ s  \[.*\]",
        table,
    ), table
    assert re.match(rf"rank 1 \(pid {pid}\):\nstate: sleeping for \d+ s, cpu [\d.]+ s\n\nCurrent thread 0x", stacks), (
        stacks
    )
    assert 'selftest.py", line' in root["traceback"] and " in _fail\n" in root["traceback"]
    assert "rank 0" not in root["traceback"]  # it had exited: nothing to say about it
    assert first["reason"] == "Stalled: " + root["message"]
    assert [r["state"] for r in first["ranks"]] == ["exited", "killed"]


def test_a_slow_stage_that_keeps_writing_is_not_stalled(daemon):
    run_id = daemon.submit(selftest_toml("slow", ranks=1, stall_timeout=1.5, options={"steps": 8, "step_time": 0.6}))
    run = daemon.wait_run(run_id, timeout=60)
    assert run["state"] == "succeeded", run
    (attempt,) = run["stages"][0]["attempt_list"]
    assert attempt["duration"] > 4.5 > 1.5  # far longer than the timeout, yet never quiet that long


def test_a_process_is_signalled_only_once_it_catches_sigusr1():
    import subprocess
    import sys

    from eyas.daemon.stacks import catches

    plain = subprocess.Popen(["sleep", "30"])
    ready = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import faulthandler, signal, sys, time; "
            "faulthandler.register(signal.SIGUSR1); print('ok', flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert ready.stdout.readline() == "ok\n"
        assert catches(ready.pid) and not catches(plain.pid)
        assert not catches(2**22 + 7)  # no such pid
    finally:
        plain.kill()
        ready.kill()


def test_runs_needing_the_same_devices_queue(daemon):
    a = daemon.submit(
        selftest_toml("gpu-a", ranks=1, devices="[0]", options={"steps": 20, "step_time": 0.05}), "a.toml"
    )
    b = daemon.submit(selftest_toml("gpu-b", ranks=1, devices="[0]", options={"steps": 5, "step_time": 0.05}), "b.toml")
    ra, rb = daemon.wait_run(a), daemon.wait_run(b)
    assert ra["state"] == rb["state"] == "succeeded"
    at = ra["stages"][0]["attempt_list"][0]
    bt = rb["stages"][0]["attempt_list"][0]
    assert bt["started_at"] >= at["ended_at"], "two groups shared GPU 0"
    assert at["devices"] == bt["devices"] == [0]
    db = daemon.reader()
    # The queue's "waiting for devices held by run 1" gave way to the run's real end.
    assert db["runs"].get(b)["reason"] == "every stage succeeded or was skipped"
    # Each rank saw its GPU through CUDA_VISIBLE_DEVICES, the torchrun way.
    assert at["ranks"][0]["device"] == "0"


def test_another_uid_is_refused_and_garbage_leaves_the_daemon_serving(daemon):
    sock = daemon.socket
    assert oct(sock.stat().st_mode & 0o777) == "0o600"
    assert oct(sock.parent.stat().st_mode & 0o777) == "0o700"
    # Open the way through the file system so the daemon's own SO_PEERCRED check is what refuses.
    opened = [p for p in [sock.parent, *sock.parent.parents] if p != Path("/") and str(p).startswith(str(daemon.home))]
    modes = {p: p.stat().st_mode & 0o777 for p in opened}
    for p in opened:
        os.chmod(p, 0o755)
    os.chmod(sock, 0o666)
    code = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        'try:\n    s.sendall(b\'{"v":1,"id":1,"op":"ping"}\\n\')\n'
        "except BrokenPipeError:\n    pass  # refused at once: the reply is already waiting\n"
        "print(s.makefile().readline())\n"
    )
    import subprocess
    import sys as _sys

    out = subprocess.run([_sys.executable, "-c", code, str(sock)], capture_output=True, text=True, timeout=30)
    for p, mode in modes.items():
        os.chmod(p, mode)
    os.chmod(sock, 0o600)
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["ok"] is False and reply["error"]["code"] == "forbidden"
    assert "uid 65534" in reply["error"]["message"]

    for junk in (
        b"\x00\xff garbage\n",
        b"[1,2]\n",
        b'{"v":1,"id":1,"op":"nope"}\n',
        b"x" * (2 << 20) + b"\n",
        b'{"v":1,"id":2,"op":"ping"',
    ):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(sock))
        s.sendall(junk)
        s.close()
    assert daemon.request("ping")["pid"] == daemon.proc.pid
    run_id = daemon.submit(selftest_toml("after-junk", ranks=1, options={"steps": 3, "step_time": 0.01}))
    assert daemon.wait_run(run_id)["state"] == "succeeded"


def test_bad_config_is_refused_with_its_lines(daemon):
    path = daemon.home / "bad.toml"
    path.write_text('name = "x"\npipeline = ["selftest"]\n[resources]\nrank = 2\n')
    out = daemon.cli("submit", path)
    assert out.returncode == 2
    assert "resources.rank: unknown key; did you mean 'resources.ranks'?" in out.stderr
    with pytest.raises(DaemonError) as err:
        daemon.request("submit", config_path=str(path))
    assert err.value.code == "invalid_config"


def test_log_subscription_streams_rank_lines(daemon):
    run_id = daemon.submit(selftest_toml("logs", ranks=2, options={"steps": 80, "step_time": 0.05}))
    seen: dict[int, str] = {0: "", 1: ""}
    with Client(daemon.socket, timeout=30) as c:
        events = c.subscribe(["log"], run=run_id)
        deadline = time.monotonic() + 30
        for ev in events:
            seen[ev.data["rank"]] += ev.data["text"]
            if all("step 20" in t for t in seen.values()) or time.monotonic() > deadline:
                break
    assert all("step 20" in t for t in seen.values()), seen
    daemon.wait_run(run_id)


def test_daemon_stop_terminates_groups_and_records_cancel(daemon):
    run_id = daemon.submit(selftest_toml("bye", ranks=2, options={"steps": 2000, "step_time": 0.05}))
    pids = _worker_pids(daemon, run_id, 2)
    out = daemon.cli("daemon", "stop")
    assert out.returncode == 0, out.stderr
    assert not any(_alive(p) for p in pids)
    run = daemon.run(run_id)
    assert (run["state"], run["stages"][0]["state"]) == ("cancelled", "cancelled")
    assert run["stages"][0]["reason"] == "the daemon was stopped"
    out = daemon.cli("daemon", "status")
    assert out.returncode == 3 and "not running" in out.stdout


def test_one_daemon_per_state_directory_and_stale_socket(tmp_path, monkeypatch):
    home = short_tmp()
    monkeypatch.setenv("EYAS_HOME", str(home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(home / "rt"))
    first = Daemon(home).start()
    try:
        second = Daemon(home)
        import subprocess
        import sys as _sys

        out = subprocess.run(
            [_sys.executable, "-m", "eyas.daemon.main", "--home", str(home)],
            env=second.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 1 and "already runs for" in out.stderr
        first.kill9()
        assert first.socket.exists()  # left behind by SIGKILL
        first.start()  # the stale socket is detected and replaced
        assert first.request("ping")["pid"] == first.proc.pid
    finally:
        first.cleanup()


def test_detached_start_status_and_stop_through_the_cli(tmp_path, monkeypatch):
    home = short_tmp()
    monkeypatch.setenv("EYAS_HOME", str(home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(home / "rt"))
    d = Daemon(home)
    try:
        out = d.cli("daemon", "start")
        assert out.returncode == 0, out.stderr
        assert "eyas daemon started (pid" in out.stdout
        out = d.cli("daemon", "status", "--json")
        info = json.loads(out.stdout)
        assert info["running"] and info["database"] == str(paths.db_path(home)) and info["active"] == []
        assert (home / "daemon.log").exists()
        out = d.cli("daemon", "stop")
        assert out.returncode == 0 and "eyas daemon stopped" in out.stdout
    finally:
        d.cleanup()
        subprocess_kill_daemons(home)


def subprocess_kill_daemons(home: Path) -> None:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "eyas.daemon.main" in cmd and str(home) in cmd:
            p.kill()


def test_gpu_path_against_a_fake_nvml(monkeypatch):
    """Device assignment and per-rank GPU memory through the real sampler and scheduler,
    with only the NVML library faked (a JSON file the daemon re-reads)."""
    home = short_tmp()
    monkeypatch.setenv("EYAS_HOME", str(home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(home / "rt"))
    fake = home / "nvml.json"
    devices = [
        {
            "name": "NVIDIA H200",
            "uuid": f"GPU-{i}",
            "mem_total": 150 * 2**30,
            "mem_used": 2**30,
            "util": 10,
            "processes": [],
        }
        for i in range(2)
    ]
    fake.write_text(json.dumps({"devices": devices}))
    d = Daemon(home, extra_env={"EYAS_FAKE_NVML": str(fake)}).start()
    try:
        run_id = d.submit(selftest_toml("gpus", ranks=2, devices='"auto"', options={"steps": 100, "step_time": 0.05}))
        pids = _worker_pids(d, run_id, 2)
        for i, pid in enumerate(pids):
            devices[i]["processes"] = [{"pid": pid, "mem": (i + 1) * 3 * 2**30}]
        fake.write_text(json.dumps({"devices": devices}))
        wait_for(lambda: all(r["peak_gpu_mem"] for r in d.ranks(run_id)), 15, what="GPU memory per rank")
        run = d.wait_run(run_id)
        assert run["state"] == "succeeded"
        ranks = run["stages"][0]["attempt_list"][0]["ranks"]
        assert [(r["device"], r["peak_gpu_mem"]) for r in ranks] == [("0", 3 * 2**30), ("1", 6 * 2**30)]
        assert run["peak_gpu_mem"] == 6 * 2**30
        assert run["stages"][0]["attempt_list"][0]["devices"] == [0, 1]
        db = d.reader()
        used = db.execute("select max(value) from metrics where name = 'gpu1.mem_used'").fetchone()[0]
        assert used == 2**30
        status = d.cli("daemon", "status", "--json")
        assert json.loads(status.stdout)["gpu"] is True
    finally:
        d.cleanup()


def test_requests_with_wrong_arguments_get_clear_errors(daemon):
    with pytest.raises(DaemonError) as err:
        daemon.request("stop", runn=1)
    assert err.value.code == "bad_request" and "(args: run, stage)" in err.value.message
    with pytest.raises(DaemonError) as err:
        daemon.request("show_me")
    assert err.value.code == "unknown_op"
    with pytest.raises(DaemonError) as err:
        daemon.request("retry", run=999)
    assert (err.value.code, err.value.message) == ("not_found", "no run 999")
    with pytest.raises(DaemonError) as err:
        daemon.request("stop", run="abc")
    assert (err.value.code, err.value.message) == ("bad_request", "run: 'abc' is not a run id (a whole number)")
    with pytest.raises(DaemonError) as err:
        daemon.request("skip", run=1, stage="nope")
    assert err.value.code == "not_found"
    assert daemon.request("ping")["pid"] == daemon.proc.pid


def test_submit_follow_streams_until_the_run_ends(daemon):
    path = daemon.home / "follow.toml"
    path.write_text(selftest_toml("follow", ranks=2, options={"steps": 20, "step_time": 0.05}))
    out = daemon.cli("submit", "--follow", path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("run 1 submitted: selftest")
    assert "run 1 follow: succeeded" in out.stdout
    path.write_text(
        selftest_toml(
            "follow-fail",
            ranks=2,
            options={"steps": 20, "step_time": 0.05, "fail": "raise", "fail_rank": 1, "fail_at_step": 3},
        )
    )
    out = daemon.cli("submit", "-f", path, timeout=120)
    assert out.returncode == 1
    assert "run 2 follow-fail: failed" in out.stdout
    assert "rank 1 RuntimeError: selftest failure" in out.stdout


async def test_an_internal_error_in_an_op_is_not_passed_off_as_the_callers_mistake(tmp_path):
    from eyas.daemon import core
    from eyas.state import store
    from eyas.wire import protocol

    c = core.Core(store.open_writer(tmp_path / "e.db"), tmp_path)
    with pytest.raises(protocol.ProtocolError) as err:
        await c.handle(protocol.Request(1, "retry", {"run": 7}))
    assert (err.value.code, str(err.value)) == (protocol.NOT_FOUND, "no run 7")

    def broken(run):
        return {}["a key eyas itself forgot"]  # a bug inside the op, not a missing run

    c.op_resume = broken
    with pytest.raises(KeyError, match="a key eyas itself forgot"):
        await c.handle(protocol.Request(2, "resume", {"run": 1}))
