"""The processes under a live rank (vLLM's tensor-parallel workers, data loaders), read
locally with psutil: the TUI runs on the machine it watches, and the daemon's samples are
per rank, summed over these processes."""

from __future__ import annotations

import psutil

from eyas.state.procs import same_start


class ProcWatch:
    """Descendants of rank processes, with CPU % measured between calls."""

    def __init__(self) -> None:
        # Kept between calls: cpu_percent(interval=None) measures since the previous call
        # on the same Process object.
        self._procs: dict[int, psutil.Process] = {}

    def descendants(self, pid: int | None, create_time: float | None) -> list[dict]:
        """[{pid, name, status, cpu_percent, rss}] of the processes below `pid`, oldest first;
        empty when `pid` is gone or is another process than the rank's (a reused pid)."""
        if not pid:
            return []
        try:
            root = psutil.Process(pid)
            if create_time and not same_start(root.create_time(), create_time):
                return []
            kids = root.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return []
        out = []
        for kid in kids:
            p = self._procs.get(kid.pid)
            if p is None or not p.is_running():
                p = self._procs[kid.pid] = kid
            try:
                with p.oneshot():
                    out.append(
                        {
                            "pid": p.pid,
                            "name": p.name(),
                            "status": p.status(),
                            "cpu_percent": p.cpu_percent(interval=None),
                            "rss": p.memory_info().rss,
                            "created": p.create_time(),
                        }
                    )
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                self._procs.pop(kid.pid, None)
        out.sort(key=lambda d: (d["created"], d["pid"]))
        return out

    def forget_missing(self, alive: set[int]) -> None:
        for pid in [p for p in self._procs if p not in alive]:
            del self._procs[pid]
