"""Did the kernel's OOM killer end a process? Read from the cgroup's oom_kill counter.

A SIGKILL from the OOM killer looks like any other SIGKILL; the only trace the kernel
leaves without privileges is the cgroup counter, so the daemon compares it before and
after a rank dies by SIGKILL.
"""

from __future__ import annotations

from pathlib import Path

_ROOT = Path("/sys/fs/cgroup")


def _candidates(pid: int | str = "self") -> list[Path]:
    paths = []
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if controllers == "":  # cgroup v2, unified
            paths += [_ROOT / rel / "memory.events", _ROOT / "memory.events"]
        elif "memory" in controllers.split(","):  # cgroup v1
            paths += [_ROOT / "memory" / rel / "memory.oom_control", _ROOT / "memory" / "memory.oom_control"]
    return paths


def oom_kill_count(paths: list[Path] | None = None) -> int | None:
    """The cgroup's oom_kill counter, or None where the kernel does not expose one."""
    for path in paths if paths is not None else _candidates():
        try:
            for line in path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None
