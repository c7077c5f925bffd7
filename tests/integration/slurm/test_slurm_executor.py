"""The Slurm executor against a real one-node Slurm (tests/support/slurm_world.py): a real daemon
submits the selftest stage as a Slurm job of 2 tasks, and the run's history, root causes and
controls are the ones a local run has, with Slurm's job id, node and reasons added."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import slurm_world
from daemon_harness import Daemon, private_daemon, wait_for
from runtoml import run_toml

pytestmark = pytest.mark.timeout(300)


def slurm_toml(name: str, options: dict | None = None, slurm: dict | None = None, **stage) -> str:
    """A selftest run of 2 ranks through the Slurm executor; `stage` adds [stages.selftest] keys."""
    return run_toml(
        name,
        ["selftest"],
        resources={"ranks": 2, "devices": "cpu", "executor": "slurm"},
        slurm=slurm or {},
        stages={"selftest": {"max_restarts": 0, "stall_timeout": 0, "options": options or {}, **stage}},
    )


@pytest.fixture(scope="module")
def daemon(slurm):
    # Only the cluster's address and the world's mark: the daemon's own EYAS_HOME must stand.
    env = {"SLURM_CONF": str(slurm.conf), slurm_world.MARK: str(slurm.root)}
    with private_daemon(extra_env=env) as d:
        yield d


def attempt_row(daemon: Daemon, run_id: int, number: int = -1) -> dict:
    db = daemon.reader()
    try:
        rows = list(db.execute("SELECT * FROM attempts WHERE run_id = ? ORDER BY number", [run_id]))
        cols = [c[0] for c in db.execute("SELECT * FROM attempts LIMIT 0").description]
    finally:
        db.conn.close()
    return dict(zip(cols, rows[number], strict=True))


def root_cause(daemon: Daemon, run_id: int) -> dict:
    db = daemon.reader()
    try:
        cur = db.execute(
            "SELECT e.* FROM errors e JOIN attempts a ON a.id = e.attempt_id WHERE a.run_id = ? AND e.root_cause = 1 "
            "ORDER BY e.id DESC LIMIT 1",
            [run_id],
        )
        cols = [c[0] for c in cur.description]
        row = cur.fetchone()
    finally:
        db.conn.close()
    assert row is not None, f"run {run_id} has no root cause"
    return dict(zip(cols, row, strict=True))


def job_of(daemon: Daemon, run_id: int, timeout: float = 30) -> int:
    def job():
        try:
            return attempt_row(daemon, run_id)["slurm_job"]
        except IndexError:  # the attempt is not recorded yet
            return None

    return wait_for(job, timeout, what=f"run {run_id}'s Slurm job")


def running_ranks(daemon: Daemon, run_id: int, n: int = 2, timeout: float = 60) -> list[dict]:
    """Wait until `n` ranks of the run have a worker pid (their tasks started on the node)."""
    return wait_for(
        lambda: (rs := daemon.ranks(run_id)) and sum(bool(r["pid"]) for r in rs) >= n and rs,
        timeout,
        what=f"{n} ranks of run {run_id} to start under Slurm",
    )


def job_gone(slurm, job: int) -> bool:
    state = slurm.job(job).get("JobState")
    return state not in ("RUNNING", "PENDING", "COMPLETING", "CONFIGURING")


def test_a_run_succeeds_as_a_slurm_job_with_its_node_and_job_recorded(slurm, daemon):
    run_id = daemon.submit(slurm_toml("ok", {"steps": 4, "step_time": 0.05}))
    run = daemon.wait_run(run_id, timeout=90)
    assert run["state"] == "succeeded", daemon.diagnose(run_id)
    a = attempt_row(daemon, run_id)
    assert a["slurm_job"] and a["nodes"] == slurm.node
    fields = slurm.wait_state(a["slurm_job"], {"COMPLETED"})
    assert fields["JobName"] == f"eyas-r{run_id}-selftest-a1"
    ranks = daemon.ranks(run_id)
    assert [(r["rank"], r["state"], r["exit_code"], r["host"]) for r in ranks] == [
        (0, "exited", 0, slurm.node),
        (1, "exited", 0, slurm.node),
    ]
    attempt_dir = Path(a["dir"])
    # Each task ran the same monitor and runtime as a local rank: its log, proc and exit records,
    # and the rank contract from Slurm's variables (RANK from SLURM_PROCID, MASTER_ADDR the node).
    for r in (0, 1):
        proc = json.loads((attempt_dir / f"rank-{r}.proc.json").read_text())
        assert proc["slurm_job"] == a["slurm_job"] and proc["host"] == slurm.node
        exit_ = json.loads((attempt_dir / f"rank-{r}.exit.json").read_text())
        assert exit_["exit_code"] == 0 and exit_["pid"] == proc["pid"]
        assert "step 4/4" in (attempt_dir / f"rank-{r}.log").read_text()
    show = daemon.cli("show", run_id).stdout
    assert f"Slurm job {a['slurm_job']} on {slurm.node}" in show, show


def test_an_empty_runtimeerror_is_the_root_cause_with_its_rank_traceback_and_job(slurm, daemon):
    run_id = daemon.submit(slurm_toml("empty", {"steps": 3, "fail": "raise-empty", "fail_rank": 1}))
    run = daemon.wait_run(run_id, timeout=90)
    assert run["state"] == "failed"
    cause = root_cause(daemon, run_id)
    assert (cause["type"], cause["message"], cause["rank"], cause["host"]) == ("RuntimeError", "", 1, slurm.node)
    assert "Traceback" in cause["traceback"] and "selftest" in cause["traceback"]
    a = attempt_row(daemon, run_id)
    assert job_gone(slurm, a["slurm_job"])
    errors = daemon.cli("errors", run_id).stdout
    assert f"Slurm job {a['slurm_job']}" in errors and "RuntimeError" in errors, errors


def test_a_rank_killed_by_sigkill_is_named_and_the_whole_step_ends(slurm, daemon):
    run_id = daemon.submit(slurm_toml("kill", {"steps": 400, "step_time": 0.05}))
    ranks = running_ranks(daemon, run_id)
    job = job_of(daemon, run_id)
    victim = next(r for r in ranks if r["rank"] == 1)
    import os

    os.kill(victim["pid"], signal.SIGKILL)  # one node: the test can reach the rank's process
    run = daemon.wait_run(run_id, timeout=60)
    assert run["state"] == "failed"
    cause = root_cause(daemon, run_id)
    assert (cause["type"], cause["rank"], cause["source"]) == ("SIGKILL", 1, "signal")
    assert wait_for(lambda: job_gone(slurm, job), 30, what="the job to end")
    other = next(r for r in daemon.ranks(run_id) if r["rank"] == 0)
    assert other["state"] == "killed"  # torn down by eyas, not a failure of its own
    for r in daemon.ranks(run_id):
        assert not _alive(r["pid"])


def test_scancel_from_outside_is_recorded_cancelled_with_slurms_reason(slurm, daemon):
    run_id = daemon.submit(slurm_toml("outside", {"steps": 400, "step_time": 0.05}))
    running_ranks(daemon, run_id)
    job = job_of(daemon, run_id)
    slurm.run("scancel", str(job))
    run = daemon.wait_run(run_id, timeout=60)
    assert run["state"] == "cancelled"
    a = attempt_row(daemon, run_id)
    assert a["state"] == "cancelled"
    assert f"Slurm job {job} was cancelled outside eyas" in a["reason"] and "CANCELLED" in a["reason"]
    db = daemon.reader()
    try:
        assert db.execute("SELECT count(*) FROM errors WHERE attempt_id = ?", [a["id"]]).fetchone()[0] == 0
    finally:
        db.conn.close()
    # eyas retry: a new attempt as a new job, resuming the steps the first one finished.
    assert daemon.cli("retry", run_id).returncode == 0
    run = daemon.wait_run(run_id, timeout=120)
    assert run["state"] == "succeeded", daemon.diagnose(run_id)
    again = attempt_row(daemon, run_id)
    assert again["number"] == 2 and again["slurm_job"] not in (None, job) and again["state"] == "succeeded"


def test_eyas_stacks_reaches_a_hung_slurm_rank(slurm, daemon):
    run_id = daemon.submit(slurm_toml("hang", {"steps": 2, "fail": "hang", "fail_rank": 0}))
    running_ranks(daemon, run_id)
    job_of(daemon, run_id)
    # "hanging" is logged just before the hang: the stack dump must show where it hangs.
    log0 = Path(attempt_row(daemon, run_id)["dir"]) / "rank-0.log"
    wait_for(lambda: "hanging" in log0.read_text(), 60, what="rank 0 to hang")
    reply = daemon.request("stacks", run=run_id)
    by_rank = {r["rank"]: r for r in reply["ranks"]}
    assert "_fail" in by_rank[0]["python"] and "selftest.py" in by_rank[0]["python"], by_rank[0]
    # The native stacks come from the rank's node, where its monitor ran py-spy (tree.py).
    assert "_fail (workers/stages/selftest.py" in by_rank[0]["native"], by_rank[0]
    assert by_rank[0]["state"] in ("sleeping", "running") and by_rank[0]["state_for"] >= 0, by_rank[0]  # from its node
    # The signal left the ranks alive: it is a request, not a kill.
    assert daemon.run(run_id)["state"] == "running"
    daemon.cli("stop", run_id)
    assert daemon.wait_run(run_id, timeout=60)["state"] == "cancelled"


def test_a_stopped_process_under_a_slurm_rank_is_named_from_its_node(slurm, daemon):
    """The node's monitor reports the rank's processes (tree.json); the watchdog on the daemon's
    host names the stopped one, by pid, what it is and its state, as it does locally."""
    run_id = daemon.submit(
        slurm_toml(
            "stopped-child",
            {"steps": 1, "heartbeat_for": 300, "heartbeat_evidence": "child"},
            stall_timeout=10,
        )
    )
    running_ranks(daemon, run_id)
    children = Path(attempt_row(daemon, run_id)["dir"]) / "rank-0.children.json"
    child = wait_for(lambda: children.exists() and json.loads(children.read_text())["children"][0], 60, what="child")
    stopped_at = time.time()
    os.kill(child, signal.SIGSTOP)
    run = daemon.wait_run(run_id, timeout=90)
    root = root_cause(daemon, run_id)
    print(f"Slurm: stopped child found {root['time'] - stopped_at:.1f} s after SIGSTOP (stall_timeout 10)")
    assert (run["state"], root["type"], root["pid"], root["rank"]) == ("failed", "Stalled", child, 0), root
    assert root["message"].startswith(
        f"selftest::EngineCore under rank 0 (pid {child}) has been stopped (SIGSTOP or a debugger holds it) for "
    ), root["message"]
    assert 10 <= root["time"] - stopped_at <= 10 + 12
    assert "no native stacks: it is stopped" in root["traceback"]


def test_the_daemon_killed_mid_job_readopts_it_and_the_stage_completes(slurm, daemon):
    run_id = daemon.submit(slurm_toml("readopt", {"steps": 60, "step_time": 0.1}))
    running_ranks(daemon, run_id)
    job = job_of(daemon, run_id)
    daemon.kill9()
    time.sleep(1.0)
    assert slurm.job(job)["JobState"] == "RUNNING"  # the job does not depend on the daemon
    daemon.start()
    run = daemon.wait_run(run_id, timeout=90)
    assert run["state"] == "succeeded", daemon.diagnose(run_id)
    a = attempt_row(daemon, run_id)
    assert (a["number"], a["slurm_job"], a["state"]) == (1, job, "succeeded")
    assert "re-adopting Slurm job" in (daemon.home / "daemon.log").read_text()


def slowest_answer(daemon: Daemon, seconds: float) -> float:
    """The longest the daemon took to answer `status` over `seconds` of asking every 0.1 s."""
    worst, end = 0.0, time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        assert daemon.request("status")["pid"] == daemon.proc.pid
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.1)
    return worst


def test_the_daemon_answers_while_slurmctld_does_not(slurm, daemon):
    # slurmctld frozen (SIGSTOP) for 4 s, under its 10 s message timeout: first while eyas
    # submits the job (sbatch waits), then while the job runs (its state queries wait). The
    # daemon answers its clients at once throughout, and the run completes once Slurm is back.
    ctld = slurm.procs["slurmctld"].pid
    os.kill(ctld, signal.SIGSTOP)
    try:
        run_id = daemon.submit(slurm_toml("frozen", {"steps": 50, "step_time": 0.2}))
        during_sbatch = slowest_answer(daemon, 4.0)
        assert during_sbatch < 1.0, f"the daemon took {during_sbatch:.1f} s to answer while sbatch waited"
        assert attempt_row(daemon, run_id)["slurm_job"] is None  # sbatch had no answer yet
    finally:
        os.kill(ctld, signal.SIGCONT)
    job = job_of(daemon, run_id)
    running_ranks(daemon, run_id)
    os.kill(ctld, signal.SIGSTOP)
    try:
        during_queries = slowest_answer(daemon, 4.0)
    finally:
        os.kill(ctld, signal.SIGCONT)
    assert during_queries < 1.0, f"the daemon took {during_queries:.1f} s to answer while scontrol waited"
    run = daemon.wait_run(run_id, timeout=90)
    assert run["state"] == "succeeded", daemon.diagnose(run_id)
    assert attempt_row(daemon, run_id)["slurm_job"] == job


@pytest.mark.slow
def test_a_job_at_its_time_limit_fails_timeout_and_restarts(slurm, daemon):
    # Attempt 1 hangs until Slurm's time limit (slurmctld checks every 30 s); attempt 2 runs clean.
    options = {"steps": 2, "fail": "hang", "fail_rank": 0, "fail_attempts": [1]}
    run_id = daemon.submit(
        slurm_toml("timeout", options, {"time_limit": "0:01"}, max_restarts=1, backoff=0.1, exit_timeout=0)
    )
    run = daemon.wait_run(run_id, timeout=240)
    assert run["state"] == "succeeded", daemon.diagnose(run_id)
    first = attempt_row(daemon, run_id, 0)
    assert first["state"] == "failed" and first["reason"].startswith("TIMEOUT"), first
    db = daemon.reader()
    try:
        cause = db.execute(
            "SELECT type, source, message FROM errors WHERE attempt_id = ? AND root_cause = 1", [first["id"]]
        ).fetchone()
        n = db.execute("SELECT count(*) FROM errors WHERE attempt_id = ?", [first["id"]]).fetchone()[0]
    finally:
        db.conn.close()
    assert cause[0] == "TIMEOUT" and cause[1] == "slurm" and f"job {first['slurm_job']}" in cause[2], cause
    assert n == 1  # the ranks' SIGTERM deaths are the time limit's consequences, not causes
    assert attempt_row(daemon, run_id, 1)["state"] == "succeeded"


def _alive(pid: int | None) -> bool:
    import psutil

    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_job_waiting_in_the_queue_is_not_a_stall(slurm, daemon):
    # Another user's job holds every CPU of the node: eyas's job waits PENDING, far past its
    # stall_timeout, and then runs and succeeds once the node is free.
    import os

    blocker = slurm.sbatch(f"--ntasks={os.cpu_count()}", "--wrap", "sleep 300")
    slurm.wait_state(blocker, {"RUNNING"})
    try:
        run_id = daemon.submit(slurm_toml("queued", {"steps": 4, "step_time": 0.05}, stall_timeout=15))
        job = job_of(daemon, run_id)
        time.sleep(17)
        assert slurm.job(job)["JobState"] == "PENDING"
        assert daemon.run(run_id)["state"] == "running"
    finally:
        slurm.run("scancel", str(blocker))
    run = daemon.wait_run(run_id, timeout=90)
    assert run["state"] == "succeeded", daemon.diagnose(run_id)


def test_gpu_memory_is_read_on_the_ranks_node_and_recorded(slurm, daemon, tmp_path):
    # The node's NVML is a fake (no GPU here), given to the job's tasks only: the daemon's own
    # sampler sees no GPU, so the figures can only have come from the ranks' monitors.
    fake = tmp_path / "gpus.json"
    fake.write_text(
        json.dumps({"devices": [{"name": "H200", "uuid": "GPU-0", "mem_total": 141_000_000_000, "processes": []}]})
    )
    slurm_cfg = {"sbatch_args": [f"--export=ALL,EYAS_FAKE_NVML={fake}"]}
    run_id = daemon.submit(slurm_toml("gpu", {"steps": 300, "step_time": 0.05}, slurm_cfg))
    pids = {r["rank"]: r["pid"] for r in running_ranks(daemon, run_id)}
    used = {0: 5_000_000_000, 1: 3_000_000_000}
    doc = {
        "name": "H200",
        "uuid": "GPU-0",
        "mem_total": 141_000_000_000,
        "processes": [{"pid": pids[r], "mem": used[r]} for r in used],
    }
    tmp = fake.with_suffix(".tmp")
    tmp.write_text(json.dumps({"devices": [doc]}))
    tmp.replace(fake)
    wait_for(
        lambda: {r["rank"]: r["peak_gpu_mem"] for r in daemon.ranks(run_id)} == {0: 5e9, 1: 3e9},
        30,
        what="each rank's GPU memory, read on its node, in the ranks table",
    )
    daemon.cli("stop", run_id)
    assert daemon.wait_run(run_id, timeout=60)["state"] == "cancelled"
