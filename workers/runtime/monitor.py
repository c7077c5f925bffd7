"""The rank monitor: `python -m eyas.workers.runtime.monitor`, one per rank (like podman's conmon).

The daemon starts it as the leader of a new session, with stdout and stderr already the
rank's log. It runs the rank runtime as its child, forwards SIGTERM/SIGINT/SIGHUP to it,
and when the child ends writes rank-<r>.exit.json. The exit status is thus kept on disk even
while the daemon is down, and a death by signal is named even though nothing in the dead
process could say so. It also keeps the log under `stages.<stage>.log_max_mb` (LogBound).
It must start fast: stdlib + psutil only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from eyas.state import contract, privacy
from eyas.state.logcut import MIB, Bound
from eyas.workers.runtime import atomic, fulldisk

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
EXIT_RESERVE = 4096  # an exit record is a few hundred bytes


def _say(text: str, stream=None) -> None:
    """One line to the log that never raises: on a full disk it is lost, and the monitor goes
    on to write the exit record, which has its own blocks."""
    try:
        print(text, file=stream or sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exit_record(pid: int, status: int) -> dict:
    """The rank-<r>.exit.json record for a raw wait status."""
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return {
        "pid": pid,
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": sig,
        "signal_name": _signal_name(sig) if sig is not None else None,
        "time": time.time(),
        "core_dumped": bool(sig is not None and os.WCOREDUMP(status)),
    }


class _Forwarder:
    """Signal handler that passes signals on to the worker, through a pidfd when it can.

    A pidfd names this very process even after it has been reaped, so a late signal can
    never hit an unrelated process that reused the pid.
    """

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.pidfd: int | None = None
        self.early: list[int] = []  # signals that came before the worker existed
        self.reaped = False

    def attach(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        try:
            self.pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            self.pidfd = None
        for sig in self.early:
            self.send(sig)

    def send(self, sig: int) -> None:
        if self.proc is None:
            self.early.append(sig)
            return
        if self.reaped:
            return
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, sig)
            else:
                os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def __call__(self, sig: int, frame: object) -> None:
        self.send(sig)


# How often the log's size is looked at. Between two looks a flood can pass the bound by at
# most this long's output; a look is one fstat, so even 8 monitors cost nothing measurable.
CHECK_S = 0.5


class LogBound(threading.Thread):
    """Cuts the rank's log (state/logcut.py) whenever it passes the bound.

    Why this way: every writer of the log (the runtime, vLLM's workers, faulthandler) holds
    it O_APPEND, so truncating it back to its head puts their next writes after the marker
    without anyone reopening anything, and the rank never waits on the monitor: it writes
    straight to the file, as before. A pipe through the monitor would make the monitor copy
    every byte and block the rank whenever it fell behind. The thread is a daemon thread:
    it dies with the monitor.
    """

    def __init__(self, path: Path, stage: str | None, mb: float):
        super().__init__(name="eyas-log-bound", daemon=True)
        self.path, self.stage, self.mb = path, stage, mb

    def run(self) -> None:
        max_bytes = int(self.mb * MIB)
        try:
            out, log = os.fstat(1), os.stat(self.path)
        except OSError:
            return
        # Only the log the daemon gave us: a monitor run by hand with stdout elsewhere cuts nothing.
        if max_bytes <= 0 or not stat.S_ISREG(out.st_mode) or (out.st_dev, out.st_ino) != (log.st_dev, log.st_ino):
            return
        bound = Bound(self.path, max_bytes, f"stages.{self.stage}.log_max_mb = {self.mb:g}")
        try:
            bound.record()
        except OSError:
            pass
        while True:
            time.sleep(CHECK_S)
            bound.check()


def main() -> int:
    # Its files (proc, exit, the log's cut marks) are owner-only whoever started it; the rank
    # picks its own umask (rank.py), the user's only for a run whose output_dir they chose.
    os.umask(privacy.OWNER_ONLY)
    raw = os.environ.get(contract.RANK) or "0"
    rank = int(raw) if raw.isdigit() else 0
    if not os.environ.get(contract.ATTEMPT_DIR):
        print(
            f"eyas: {contract.ATTEMPT_DIR} is not set: the rank monitor runs under the daemon, "
            "which sets it to the attempt's directory",
            file=sys.stderr,
        )
        return 2
    attempt_dir = Path(os.environ[contract.ATTEMPT_DIR])

    def file(kind: str) -> Path:
        return attempt_dir / contract.rank_file(rank, kind)

    forwarder = _Forwarder()
    # Handlers go in before the spawn, so a signal in between is not lost.
    for sig in FORWARDED:
        signal.signal(sig, forwarder)
    # The exit record's blocks, taken before the rank can fill the disk (fulldisk.py).
    exit_reserve = fulldisk.Reserve(file(contract.EXIT), EXIT_RESERVE)
    exit_reserve.hold()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "eyas.workers.runtime.rank"], stdin=subprocess.DEVNULL)
    except OSError as exc:
        # Rare (a broken interpreter path): record it like any rank error, so it is not silent.
        from eyas.workers.runtime import rank as runtime

        record = runtime.error_record(
            exc,
            rank=rank,
            stage=os.environ.get(contract.STAGE),
            attempt=runtime.int_or_none(os.environ.get(contract.ATTEMPT)),
        )
        exit_reserve.release()  # no rank, no exit record: the error file is the record
        runtime.write_error(file(contract.ERROR), record)
        _say(f"eyas: rank {rank}: could not start the rank runtime: {exc}")
        return 1
    forwarder.attach(proc)
    try:
        mb = float(os.environ.get(contract.LOG_MAX_MB) or 0)
    except ValueError:
        mb = 0.0
    LogBound(file(contract.LOG), os.environ.get(contract.STAGE), mb).start()
    if os.environ.get(contract.REMOTE) == "1":
        # The daemon cannot read a Slurm rank's GPU memory from its host: taken here (node_gpu.py).
        from eyas.workers.runtime.node_gpu import NodeGpuMemory

        NodeGpuMemory(proc.pid, file(contract.PROGRESS)).start()
        # Its processes' states for the watchdog, and their native stacks when `eyas stacks` or
        # the watchdog signals the job (tree.py). The handler goes in only now: one set before
        # the spawn would be reset to SIGUSR1's default (death) in the rank, before its runtime
        # registers its own dump.
        from eyas.workers.runtime.tree import NodeTree

        tree = NodeTree(proc.pid, file(contract.TREE), file(contract.NATIVE))
        tree.start()
        signal.signal(signal.SIGUSR1, tree.ask_native)
    try:
        atomic.write_json(
            file(contract.PROC),
            {
                "monitor_pid": os.getpid(),
                "monitor_create_time": psutil.Process().create_time(),
                "pid": proc.pid,
                "create_time": psutil.Process(proc.pid).create_time(),
                # Where it runs: a Slurm rank's pids mean something only on its node, and
                # the daemon learns the rank by its job (daemon/slurmgroup.py).
                "host": socket.gethostname(),
                "slurm_job": int(os.environ["SLURM_JOB_ID"]) if os.environ.get("SLURM_JOB_ID", "").isdigit() else None,
            },
        )
    except (OSError, psutil.Error) as exc:
        # Keep supervising: the exit file is still worth having.
        _say(f"eyas: rank {rank}: could not write {file(contract.PROC).name}: {exc}")

    # os.waitpid rather than proc.wait(): only the raw status tells a core dump. It is
    # retried on EINTR (PEP 475), so forwarded signals do not end the wait.
    _, status = os.waitpid(proc.pid, 0)
    forwarder.reaped = True
    proc.returncode = os.waitstatus_to_exitcode(status)  # stop Popen from reaping again
    record = exit_record(proc.pid, status)
    if forwarder.pidfd is not None:
        os.close(forwarder.pidfd)
    # The rank's error-file blocks, left by a rank that was killed before it could give them back.
    fulldisk.Reserve(file(contract.ERROR)).release()
    if record["signal"] is not None:
        core = " (core dumped)" if record["core_dumped"] else ""
        _say(f"eyas: rank {rank} (pid {proc.pid}) was killed by {record['signal_name']}{core}", sys.stdout)
    try:
        exit_reserve.write((json.dumps(record, indent=1) + "\n").encode("utf-8"))
    except OSError as exc:
        _say(f"eyas: rank {rank}: could not write {file(contract.EXIT).name}: {exc}")
    if record["signal"] is not None:
        return 128 + record["signal"]
    return record["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
