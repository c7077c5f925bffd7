"""daemon/slurmjob.py without a cluster: the batch script an attempt is submitted with, and the job
states read back from scontrol's words."""

from __future__ import annotations

import shlex
from pathlib import Path

from eyas.daemon import slurmjob


def lines(text: str, prefix: str) -> list[str]:
    return [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]


def test_a_4_node_training_stage_asks_8_tasks_and_8_gpus_per_node():
    slurm = {"nodes": 4, "gpus_per_node": 8, "partition": "gpu", "time_limit": "1:00:00", "sbatch_args": ["--qos=hi"]}
    text = slurmjob.script(
        name="eyas-r3-train-a1",
        attempt_dir=Path("/shared/runs/3/train/attempt-1"),
        world_size=32,
        exports={"EYAS_STAGE": "train", "EYAS_CONFIG": "/shared/runs/3/config with space.json"},
        python="/opt/eyas/.venv/bin/python",
        slurm=slurm,
    )
    assert text.startswith("#!/bin/bash\n")
    assert lines(text, "#SBATCH ") == [
        "--job-name=eyas-r3-train-a1",
        "--ntasks=32",
        "--output=/shared/runs/3/train/attempt-1/slurm-%j.out",
        "--chdir=/shared/runs/3/train/attempt-1",
        "--no-requeue",
        "--nodes=4",
        "--ntasks-per-node=8",
        "--partition=gpu",
        "--time=1:00:00",
        "--gpus-per-node=8",
        "--qos=hi",
    ]
    exports = dict(shlex.split(x)[0].split("=", 1) for x in lines(text, "export "))
    assert exports == {"EYAS_CONFIG": "/shared/runs/3/config with space.json", "EYAS_STAGE": "train"}
    assert text.rstrip().endswith(
        "srun --kill-on-bad-exit=0 /opt/eyas/.venv/bin/python -m eyas.workers.runtime.slurm_task"
    )


def test_a_one_rank_cpu_stage_of_that_run_takes_one_node_and_no_gpu():
    text = slurmjob.script(
        name="n",
        attempt_dir=Path("/a"),
        world_size=1,
        exports={},
        python="p",
        slurm={"nodes": 4, "gpus_per_node": 8},
        gpus=False,
    )
    opts = lines(text, "#SBATCH ")
    assert "--nodes=1" in opts and "--ntasks-per-node=1" in opts
    assert not any(o.startswith("--gpus") for o in opts)


def test_extraction_as_one_engine_per_node():
    text = slurmjob.script(
        name="n", attempt_dir=Path("/a"), world_size=4, exports={}, python="p", slurm={"nodes": 4, "gpus_per_node": 8}
    )
    assert {"--ntasks=4", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8"} <= set(lines(text, "#SBATCH "))


def test_job_states_read_as_live_completing_or_ended():
    assert slurmjob.JobState(1, "PENDING").live and slurmjob.JobState(1, "RUNNING").live
    done = slurmjob.JobState(1, "COMPLETING")
    assert done.completing and not done.live and not done.ended
    timeout = slurmjob.JobState(1, "TIMEOUT", "TimeLimit")
    assert timeout.ended and timeout.words == "TIMEOUT (reason TimeLimit)"
    assert slurmjob.JobState(1, slurmjob.UNKNOWN).ended
    assert {"TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"} <= slurmjob.SLURM_FAILURES
    assert not slurmjob.NATURAL & slurmjob.SLURM_FAILURES and "CANCELLED" not in slurmjob.SLURM_FAILURES


def test_scontrols_fields_and_times():
    f = slurmjob._fields(
        "JobId=7 JobName=eyas-r1-x-a1 JobState=TIMEOUT Reason=TimeLimit NodeList=gpu[01-02] EndTime=2026-12-04T17:03:00"
    )
    assert (f["JobState"], f["Reason"], f["NodeList"]) == ("TIMEOUT", "TimeLimit", "gpu[01-02]")
    assert slurmjob._time("Unknown") is None
    assert slurmjob._time(f["EndTime"]) == __import__("datetime").datetime(2026, 12, 4, 17, 3).timestamp()


def test_an_attempts_job_name_is_unique_to_it():
    assert slurmjob.job_name(12, "extract", 3) == "eyas-r12-extract-a3"
