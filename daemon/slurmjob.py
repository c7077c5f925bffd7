"""Slurm's own interfaces as the daemon uses them: write and submit an attempt's batch script (sbatch),
read a job's state (scontrol, else sacct, else squeue), signal and cancel it (scancel).

The daemon drives Slurm through its command-line clients, as a user would: they are what every
Slurm site installs and keeps compatible (pyslurm must match the cluster's exact version), and
they read the cluster from the environment the daemon runs in (SLURM_CONF included).

A job's state strings are Slurm's (JobState, Reason). While a job is COMPLETING, Slurm masks the
state it is ending in (CANCELLED, TIMEOUT, ...): that is known only once it leaves COMPLETING.
"""

from __future__ import annotations

import datetime
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Where the clients live: a daemon started from a non-login shell may lack sbin on PATH.
_SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/usr/local/bin", "/usr/sbin", "/bin"])
TIMEOUT_S = 30.0  # a slurmctld that does not answer in this long is reported, never waited on forever

# The job is still Slurm's to run (or to start).
LIVE = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SIGNALING"}
)
# The job's script ended by itself: its ranks' own records say how the attempt went.
NATURAL = frozenset({"COMPLETED", "FAILED"})
# Slurm ended the job: recorded with Slurm's reason as the attempt's root cause, and restarted
# under max_restarts like any failure (CANCELLED, by someone outside eyas, is a stop instead).
SLURM_FAILURES = frozenset({"TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
UNKNOWN = "UNKNOWN"  # slurmctld forgot the job (MinJobAge) and no accounting remembers it


class SlurmError(OSError):
    """A Slurm client failed (not installed, slurmctld unreachable, the job refused); its words kept."""


def program(name: str) -> str:
    found = shutil.which(name, path=_SEARCH)
    if found is None:
        raise SlurmError(
            f'{name} is not installed on the daemon\'s host: resources.executor = "slurm" runs the daemon '
            "on a node with Slurm's client commands (sbatch, squeue, scontrol, scancel)"
        )
    return found


def _run(*argv: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [program(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv)} did not answer in {timeout:.0f}s (is slurmctld up?)") from None


@dataclass(frozen=True)
class JobState:
    """One reading of a job."""

    job_id: int
    state: str  # scontrol's JobState ("RUNNING", "COMPLETING", "TIMEOUT", ...) or UNKNOWN
    reason: str | None = None  # scontrol's Reason ("TimeLimit", "NodeDown", ...); None: "None"
    nodes: str | None = None  # the allocation's hostlist; None before it has one
    exit_code: str | None = None  # "code:signal", the batch script's
    end_time: float | None = None  # unix time, to the second

    @property
    def live(self) -> bool:
        return self.state in LIVE

    @property
    def completing(self) -> bool:
        return self.state == "COMPLETING"

    @property
    def ended(self) -> bool:
        return not self.live and not self.completing

    @property
    def words(self) -> str:
        """The state as a sentence's end: "TIMEOUT (reason TimeLimit)"."""
        return self.state + (f" (reason {self.reason})" if self.reason else "")


# -- the batch script ------------------------------------------------------------------------------


def job_name(run_id: int, stage: str, attempt: int) -> str:
    """An attempt's job name: unique per attempt, so a restarted daemon finds a job it submitted
    but did not live to record (find())."""
    return f"eyas-r{run_id}-{stage}-a{attempt}"


def script(
    *,
    name: str,
    attempt_dir: Path,
    world_size: int,
    exports: dict[str, str],
    python: str,
    slurm: dict,
    gpus: bool = True,
) -> str:
    """The batch script of one attempt: one task per rank, each `srun` task the rank launcher
    (workers/runtime/slurm_task.py), eyas's contract exported. `slurm` is the run's [slurm] table;
    `gpus`: the stage uses GPUs (prepare and vocab ask for none)."""
    opts = [
        f"--job-name={name}",
        f"--ntasks={world_size}",
        f"--output={attempt_dir}/slurm-%j.out",
        f"--chdir={attempt_dir}",
        # A requeued job would run its tasks again into this attempt's files; eyas restarts a
        # failed attempt itself, into a new folder, under max_restarts.
        "--no-requeue",
    ]
    # Never more nodes than tasks: a one-rank stage of a 4-node run takes one node.
    nodes = min(slurm.get("nodes") or 0, world_size)
    if nodes:
        opts.append(f"--nodes={nodes}")
        if world_size % nodes == 0:
            opts.append(f"--ntasks-per-node={world_size // nodes}")
    for key, flag in (("partition", "--partition"), ("account", "--account"), ("time_limit", "--time")):
        if slurm.get(key):
            opts.append(f"{flag}={slurm[key]}")
    if gpus and slurm.get("gpus_per_node"):
        opts.append(f"--gpus-per-node={slurm['gpus_per_node']}")
    opts += list(slurm.get("sbatch_args") or ())
    lines = ["#!/bin/bash", *(f"#SBATCH {shlex.quote(o)}" for o in opts)]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(exports.items())]
    # --kill-on-bad-exit=0: a rank's failure is the daemon's to see and answer (it tears the
    # whole step down with scancel), as for a local group; each task is a monitor that
    # records its worker's end before it exits.
    lines.append(f"exec srun --kill-on-bad-exit=0 {shlex.quote(python)} -m eyas.workers.runtime.slurm_task")
    return "\n".join(lines) + "\n"


def submit(path: Path) -> int:
    """sbatch the script at `path`; the job's id."""
    p = _run("sbatch", "--parsable", str(path))
    if p.returncode:
        raise SlurmError(f"sbatch refused the job: {(p.stderr or p.stdout).strip()}")
    try:
        return int(p.stdout.strip().split(";")[0])
    except ValueError:
        raise SlurmError(f"sbatch answered {p.stdout.strip()!r}, not a job id") from None


def find(name: str) -> int | None:
    """The id of the live job called `name`, if Slurm has one."""
    p = _run("squeue", "-h", "-n", name, "-o", "%i")
    ids = [int(x) for x in p.stdout.split() if x.isdigit()] if p.returncode == 0 else []
    return max(ids) if ids else None


# -- state -----------------------------------------------------------------------------------------


def _time(text: str | None) -> float | None:
    if not text or text in ("Unknown", "None", "N/A"):
        return None
    try:
        return datetime.datetime.fromisoformat(text).timestamp()  # the controller's local time
    except ValueError:
        return None


def _fields(text: str) -> dict[str, str]:
    # "Key=Value Key=Value ...": the values read here hold no spaces.
    return dict(re.findall(r"(\w+)=(\S*)", text))


def query(job_id: int) -> JobState:
    """The job's state now: scontrol while slurmctld remembers it, else sacct where accounting
    is kept, else UNKNOWN."""
    p = _run("scontrol", "show", "job", "-o", str(job_id))
    if p.returncode == 0 and p.stdout.strip():
        f = _fields(p.stdout)
        return JobState(
            job_id,
            f.get("JobState", UNKNOWN),
            None if f.get("Reason") in (None, "None") else f["Reason"],
            None if f.get("NodeList") in (None, "(null)", "") else f["NodeList"],
            f.get("ExitCode"),
            _time(f.get("EndTime")),
        )
    if "Invalid job id" not in (p.stderr or ""):
        raise SlurmError(f"scontrol show job {job_id}: {(p.stderr or p.stdout).strip()}")
    s = _run("sacct", "-X", "-n", "-P", "-j", str(job_id), "-o", "State,Reason,NodeList,ExitCode,End")
    rows = [line.split("|") for line in s.stdout.splitlines() if line.strip()] if s.returncode == 0 else []
    if rows and len(rows[0]) == 5:
        state, reason, nodes, code, end = rows[0]
        # sacct writes "CANCELLED by 1000"; the first word is the state.
        return JobState(
            job_id, state.split()[0], None if reason in ("", "None") else reason, nodes or None, code, _time(end)
        )
    return JobState(job_id, UNKNOWN)


# -- signals ---------------------------------------------------------------------------------------


def signal(job_id: int, name: str) -> None:
    """Send signal `name` ("TERM", "USR1") to every task of the job's steps, not to its batch
    script: the job goes on unless the tasks end."""
    p = _run("scancel", f"--signal={name}", str(job_id))
    if p.returncode:
        raise SlurmError(f"scancel --signal={name} {job_id}: {(p.stderr or p.stdout).strip()}")


def cancel(job_id: int) -> None:
    """End the job: Slurm sends SIGTERM, then SIGKILL after the cluster's KillWait."""
    p = _run("scancel", str(job_id))
    if p.returncode:
        raise SlurmError(f"scancel {job_id}: {(p.stderr or p.stdout).strip()}")
