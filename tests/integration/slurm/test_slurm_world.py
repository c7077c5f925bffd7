"""The one-node Slurm cluster of tests/support/slurm_world.py does what a cluster does: it runs
a job's tasks, cancels a job, ends a job at its time limit, and leaves no process behind."""

from __future__ import annotations

import os
import shlex

import psutil
import pytest
import slurm_world
from daemon_harness import wait_for


def test_the_node_is_idle_with_the_machines_cpus(slurm, record_property):
    record_property("startup_seconds", round(slurm.startup_seconds, 2))
    slurm.wait_idle()  # a test before may have left a job completing
    fields = slurm.run("sinfo", "-h", "-N", "-o", "%N %T %c").stdout.split()
    assert fields == [slurm.node, "idle", str(os.cpu_count())]


def test_a_job_runs_one_line_per_task(slurm):
    out = slurm.shared / "tasks.txt"
    # Single quotes: each task expands its own SLURM_PROCID, not the batch script's.
    task = f"echo $SLURM_JOB_ID $SLURM_PROCID >> {shlex.quote(str(out))}"
    job = slurm.sbatch("--ntasks=2", "--wrap", f"srun sh -c {shlex.quote(task)}")
    fields = slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"})
    assert fields["JobState"] == "COMPLETED", fields
    assert sorted(out.read_text().splitlines()) == [f"{job} 0", f"{job} 1"]


def test_scancel_ends_a_job_cancelled(slurm):
    job = slurm.sbatch("--wrap", "sleep 300")
    slurm.wait_state(job, {"RUNNING"})
    slurm.run("scancel", str(job))
    assert slurm.wait_state(job, {"CANCELLED"}, timeout=30)["JobState"] == "CANCELLED"
    assert slurm.run("squeue", "-h", "-t", "all", "-j", str(job), "-o", "%T").stdout.strip() == "CANCELLED"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_job_past_its_time_limit_ends_timeout(slurm):
    # Slurm's shortest limit is a minute, and slurmctld looks every 30 s: this takes 60-100 s.
    job = slurm.sbatch("--time=0:01", "--wrap", "sleep 600")
    slurm.wait_state(job, {"RUNNING"})
    fields = slurm.wait_state(job, {"TIMEOUT", "COMPLETED", "FAILED", "CANCELLED"}, timeout=180)
    assert fields["JobState"] == "TIMEOUT"
    assert fields["TimeLimit"] == "00:01:00"
    minutes, seconds = fields["RunTime"].split(":")[-2:]
    assert int(minutes) * 60 + int(seconds) >= 60


def test_stop_leaves_no_process_behind():
    reason = slurm_world.slurm_unavailable()
    if reason:
        pytest.skip(reason)
    with slurm_world.running() as world:
        job = world.sbatch("--ntasks=2", "--wrap", "srun sleep 300")
        world.wait_state(job, {"RUNNING"})
        # The daemons, a step daemon, the batch script, srun and the tasks: RUNNING is the batch
        # script's start, and srun's step and its tasks come after it (seconds, on a loaded machine).
        wanted = {"munged", "slurmctld", "slurmd", "slurmstepd", "sleep"}
        started = wait_for(
            lambda: (found := world.marked()) and wanted <= {p.name() for p in found} and found,
            60,
            0.2,
            "the job's step and its tasks to start",
        )
    assert all(p.poll() is not None for p in world.procs.values())
    # A step daemon's parent is init, which reaps it: a zombie is an exit not yet collected.
    assert [p for p in started if _alive(p)] == []
    assert not world.root.exists()


def test_without_slurm_and_root_the_reason_says_what_to_install(monkeypatch):
    monkeypatch.setattr(slurm_world, "program", lambda name: None)
    monkeypatch.setattr(slurm_world.os, "geteuid", lambda: 1000)
    monkeypatch.delenv("EYAS_SLURM_NO_INSTALL", raising=False)
    reason = slurm_world.slurm_unavailable()
    assert reason.startswith(f"Slurm is not installed ({', '.join(slurm_world.PROGRAMS)} missing)")
    assert "needs root" in reason and "apt-get install -y slurm-wlm munge" in reason
    monkeypatch.setenv("EYAS_SLURM_NO_INSTALL", "1")
    assert "EYAS_SLURM_NO_INSTALL forbids" in slurm_world.slurm_unavailable()


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
