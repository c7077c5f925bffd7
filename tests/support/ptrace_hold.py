"""Hold processes so that nothing but SIGKILL ends them, and no SIGCONT resumes them (tests).

A test that needs a rank to outlive its daemon's teardown cannot use SIGSTOP alone: the daemon
continues stopped processes after its SIGTERM (daemon/group.py), as systemd does, and the
pending SIGTERM then ends them at once. Under ptrace every thread is held in a ptrace-stop
instead: SIGCONT does not wake a traced thread, a SIGTERM stays pending, and SIGKILL still ends
it, which is the daemon's own last resort. A helper process is the tracer (`held`), so that the
test's threads are free and every held thread is reaped when it dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PTRACE_SEIZE = 0x4206
WALL = 0x40000000  # __WALL: wait for every traced thread, not only the tracer's children
READY = "held"


def _tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def _state(tid: int) -> str:
    try:
        stat = Path(f"/proc/{tid}/stat").read_text()
    except FileNotFoundError:
        return "X"
    return stat[stat.rindex(")") + 2]


def _hold(pids: list[int]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    # Stop first: a stopped process starts no new thread while its threads are listed and seized.
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while any(_state(t) not in "TtXZ" for pid in pids for t in _tasks(pid)):
        if time.monotonic() > deadline:
            print("threads did not stop in 10 s", file=sys.stderr)
            return 1
        time.sleep(0.01)
    for tid in [t for pid in pids for t in _tasks(pid)]:
        # A stopped thread that is seized moves into a ptrace-stop, where only its tracer resumes it.
        if libc.ptrace(PTRACE_SEIZE, tid, None, None) != 0:
            err = ctypes.get_errno()
            print(f"ptrace(PTRACE_SEIZE, {tid}): {os.strerror(err)}", file=sys.stderr)
            return 1
    print(READY, flush=True)
    # Never restart a thread: reap each one as it dies, until none is left.
    while True:
        try:
            os.waitpid(-1, WALL)
        except ChildProcessError:
            return 0
        except InterruptedError:
            continue
        except OSError as exc:
            if exc.errno == errno.ECHILD:
                return 0
            raise


@contextlib.contextmanager
def held(pids: list[int]):
    """Hold `pids` (every thread of each) until SIGKILL ends them; the tracer is released at exit."""
    tracer = subprocess.Popen(
        [sys.executable, __file__, *map(str, pids)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = tracer.stdout.readline().strip()
    if line != READY:
        tracer.kill()
        raise RuntimeError(f"could not hold {pids}: {tracer.stderr.read().strip() or line}")
    try:
        yield tracer
    finally:
        if tracer.poll() is None:
            tracer.kill()  # its tracees are detached and resumed: the pending SIGTERM ends them
        tracer.wait()


if __name__ == "__main__":
    sys.exit(_hold([int(a) for a in sys.argv[1:]]))
