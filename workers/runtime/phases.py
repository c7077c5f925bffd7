"""The budgets and the evidence of a rank's long silent phases: how long a phase may take at most,
derived from its work, and the counters that show it working (for `ProgressWriter.beating`).

A heartbeat alone proves only that one thread of the rank still runs. The daemon believes a phase
while its evidence moves and it is inside its budget (daemon/phases.py). The floors below are
deliberately slow, so that a budget only ends a phase that has stopped making sense: a weight
load at 50 MB/s per process is slower than any local disk or parallel filesystem a GPU node has.
`[stages.<name>] phase_budgets` overrides them per kind (state/executiontables.py).

Stdlib only: it runs inside every rank before anything heavy is imported.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# The slowest read and write a healthy node does, per process, in bytes per second.
FLOOR_READ_BYTES_S = 50e6
FLOOR_WRITE_BYTES_S = 50e6
# Seconds every load, save and build may take on top of its bytes: imports, allocation, a
# filesystem's first metadata round trips.
BASE_S = 600.0
# What a vLLM engine does after its weights are in: memory profiling, torch.compile, CUDA graph
# capture. Minutes on a large target, never an hour.
ENGINE_EXTRA_S = 1200.0


def weight_bytes(target: str | os.PathLike[str] | None) -> int:
    """The bytes of a local target's weight files (safetensors, then legacy .bin); 0 when unknown."""
    if not target:
        return 0
    root = Path(target)
    try:
        files = [e for e in os.scandir(root) if e.is_file() and e.name.endswith((".safetensors", ".bin", ".pt"))]
    except OSError:
        return 0
    return sum(e.stat().st_size for e in files)


def load_budget(target, share: int = 1) -> float:
    """Seconds a process may take to load its `1/share` of the target's weights."""
    return BASE_S + weight_bytes(target) / max(1, share) / FLOOR_READ_BYTES_S


def engine_budget(target, tensor_parallel_size: int = 1) -> float:
    """Seconds a vLLM engine may take to start: its workers' loads (in parallel, a TP share
    each), then profiling and compilation."""
    return load_budget(target, tensor_parallel_size) + ENGINE_EXTRA_S


def save_budget(nbytes: int) -> float:
    """Seconds a save of `nbytes` may take."""
    return BASE_S + max(0, nbytes) / FLOOR_WRITE_BYTES_S


def data_budget(path: str | os.PathLike[str] | None) -> float:
    """Seconds a pass over a data file (or a folder of them) may take."""
    if not path:
        return BASE_S
    p = Path(path)
    try:
        size = p.stat().st_size if p.is_file() else sum(e.stat().st_size for e in os.scandir(p) if e.is_file())
    except OSError:
        size = 0
    return BASE_S + size / FLOOR_READ_BYTES_S


def io_evidence() -> dict[str, Any]:
    """This process's I/O so far (/proc/self/io): bytes it read and wrote through system calls
    (rchar, wchar) and from storage (read_bytes). A load through mmap shows in read_bytes, a
    plain read in rchar; the daemon's CPU figure covers what neither shows."""
    out: dict[str, Any] = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("rchar", "wchar", "read_bytes", "write_bytes"):
                    out[key] = int(value)
    except (OSError, ValueError):
        pass
    return out


def files_evidence(directory: str | os.PathLike[str], suffix: str = "") -> dict[str, Any]:
    """How many files of `directory` end with `suffix`, and their bytes: a writer's progress."""
    n = size = 0
    try:
        for e in os.scandir(directory):
            if e.is_file() and e.name.endswith(suffix):
                n += 1
                size += e.stat().st_size
    except OSError:
        pass
    return {"files": n, "bytes": size}
