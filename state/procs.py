"""Process identity: a (pid, create_time) pair names one process for good, give or take a clock step.

The daemon (re-adopting ranks, tearing groups down), its sampler and the TUI all ask "is this
still the process we started?", and they must give the same answer, so the rule lives once.
"""

from __future__ import annotations

import psutil

# psutil's create_time() is boot time + ticks since boot, and the kernel recomputes boot time
# from the wall clock, so one process can read a second apart after a clock step (NTP, a VM
# resumed). A pid is never recycled within a second, so this slack cannot confuse two processes.
CREATE_TIME_SLACK_S = 1.0


def same_start(created: float, create_time: float | None) -> bool:
    """Whether a process created at `created` is the one recorded as `create_time` (None: any)."""
    return create_time is None or abs(created - create_time) <= CREATE_TIME_SLACK_S


def alive(pid: int | None, create_time: float | None) -> bool:
    """Is the process (pid, create_time) still running? A recycled pid or a zombie is not."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        return same_start(proc.create_time(), create_time) and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
