"""A vLLM driver's own reading of its TP workers' failure: when the daemon cannot watch those workers, the driver re-raises the first worker's recorded exception instead of vLLM's flattened one.

The daemon reads a TP worker's `tp-<k>.error.json` itself for the engine of driver rank 0 on its
own host (daemon/tpworkers.py). It cannot for the other drivers of a data-parallel extraction
(their files lie in `driver-<r>/`) nor for any driver run by Slurm on another node. There the
driver would end with what vLLM hands it, often `RuntimeError("")` (the seed's failure): this
module turns that into the worker's own type, message and traceback, so the root cause is never
empty wherever the engine runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eyas.state import contract


class TPWorkerFailed(RuntimeError):
    """A TP worker of this rank's engine raised; recorded as the worker's exception
    (workers/runtime/rank.py reads `eyas_record`)."""

    def __init__(self, record: dict, engine_error: BaseException, driver_rank: int):
        self.record = record
        k, pid = record.get("tp_rank"), record.get("pid")
        where = f"raised in TP rank {k} (pid {pid}) of rank {driver_rank}'s vLLM engine"
        flat = f"{type(engine_error).__name__}({str(engine_error)!r})"
        self.eyas_record = {
            "type": record.get("type") or "Exception",
            "message": record.get("message") or "",
            "traceback": (record.get("traceback") or "").rstrip() + f"\n\n({where}; the engine reported {flat})\n",
        }
        super().__init__(f"TP rank {k}: {self.eyas_record['type']}: {self.eyas_record['message']}")


def watched_by_daemon(driver_rank: int) -> bool:
    """Whether the daemon reads this driver's TP worker files itself: driver rank 0, on its host."""
    return driver_rank == 0 and os.environ.get(contract.REMOTE) != "1"


def first_failure(attempt_dir: Path, driver_rank: int) -> dict | None:
    """The earliest error record of this driver's TP workers, if one wrote any."""
    sub = contract.tp_dir_name(driver_rank)
    folder = attempt_dir / sub if sub else attempt_dir
    found = []
    for path in folder.glob(f"tp-*.{contract.ERROR}"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("driver_rank") in (None, driver_rank):
            found.append(record)
    return min(found, key=lambda r: float(r.get("time") or 0), default=None)


def surfaced(exc: BaseException, attempt_dir: Path, driver_rank: int) -> BaseException | None:
    """The exception to raise instead of `exc`, or None to let `exc` stand."""
    if watched_by_daemon(driver_rank):
        return None
    record = first_failure(attempt_dir, driver_rank)
    return TPWorkerFailed(record, exc, driver_rank) if record else None
