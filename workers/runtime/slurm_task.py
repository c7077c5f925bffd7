"""One Slurm task of an attempt: `srun python -m eyas.workers.runtime.slurm_task` turns the task's Slurm
environment into eyas's rank contract, makes the rank's log its stdout and stderr, and becomes the
rank monitor (exec), so that a rank under Slurm is the same monitor and runtime as a local one.

What the daemon does for a local rank before starting its monitor (daemon/group.py's _start_rank)
is done here, on the task's node: the environment (state/slurm.py's rank_env: RANK from
SLURM_PROCID, MASTER_ADDR the allocation's first node, ...), the log file `rank-<r>.log` in the
attempt directory on the shared filesystem, the attempt directory as working directory.

SIGUSR1 is set to be ignored before the exec: `eyas stacks` reaches Slurm ranks through
`scancel --signal=USR1`, which signals every process of the job's steps, the monitor and a
runtime that has not registered its stack dump yet included; an ignored signal's disposition
survives exec, so neither dies of it, and the runtime's faulthandler replaces it once registered.
Its umask is 077, which the exec'd monitor keeps: the log and the monitor's records are
owner-only, as a local rank's are (state/privacy.py).
Stdlib and state/ only: it runs once per task, before anything else.
"""

from __future__ import annotations

import os
import signal
import sys

from eyas.state import contract, privacy, slurm


def main() -> int:
    # Owner-only, as the daemon's own processes are (state/privacy.py): Slurm starts the task
    # with the umask sbatch saw, which need not be the daemon's; the monitor exec'd below keeps it.
    os.umask(privacy.OWNER_ONLY)
    try:
        task = slurm.task_from_environ(os.environ)
        env = slurm.rank_env(task)
    except slurm.SlurmEnvError as exc:
        print(f"eyas: this Slurm task cannot start a rank: {exc}", file=sys.stderr, flush=True)
        return 2
    os.environ.update(env)
    os.environ[contract.REMOTE] = "1"
    attempt_dir = env[contract.ATTEMPT_DIR]
    log_path = os.path.join(attempt_dir, contract.rank_file(task.rank, contract.LOG))
    try:
        # Exclusively, as the daemon makes a local rank's log: a task started twice into one
        # attempt (a requeue eyas did not ask for) must not write into the first one's files.
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
    except OSError as exc:
        print(f"eyas: rank {task.rank}: cannot create its log {log_path}: {exc}", file=sys.stderr, flush=True)
        return 2
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(attempt_dir)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # The monitor's name from the contract, not state/specs.py, which would import pydantic
    # into every task just to spell it.
    os.execv(sys.executable, [sys.executable, "-m", contract.MONITOR_MODULE])
    return 1  # not reached: execv replaces this process or raises


if __name__ == "__main__":
    sys.exit(main())
