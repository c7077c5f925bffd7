"""Several ranks each driving a vLLM engine over one batch plan: each rank's share of the plan, and the ranks' totals gathered on rank 0 through files in the attempt directory.

Extract's vllm backend (backend.py) and the regenerate stage run their engines data parallel so.
"""

from __future__ import annotations

import json
import time

from eyas.state.slurm import node_batches
from eyas.workers.runtime import atomic


def share(plan: list[list[int]], lengths, rank: int, world_size: int) -> list[list[int]]:
    """Rank `rank`'s batches of the one plan: all of them for a single engine; else its deal by
    tokens (state/slurm.py's node_batches), each batch whole on exactly one engine, so every
    engine computes the batches (and paddings) a single one would, and a retry the same."""
    if world_size == 1:
        return plan
    return node_batches(plan, lengths, rank, world_size)


GATHER_POLL_S = 0.5


def gather(ctx, totals: list[int], steps: dict) -> list[int]:
    """With several engines: every rank's totals, summed, on rank 0 (the others get their own).

    Through files in the attempt directory rather than torch.distributed: the driver's process
    stays free of a process group beside vLLM's own, and under Slurm the attempt directory is
    the one place every node shares. A rank that fails instead of reporting ends the attempt
    (the daemon tears rank 0 down with it), so rank 0 waits without a timeout of its own; the
    stall watchdog still sees its heartbeat."""
    if ctx.world_size == 1:
        return totals
    atomic.write_json(ctx.attempt_dir / f"rank-{ctx.rank}.engine.json", {"totals": totals, "steps": steps})
    if ctx.rank != 0:
        return totals
    want = [ctx.attempt_dir / f"rank-{r}.engine.json" for r in range(ctx.world_size)]
    with ctx.progress.beating(
        "waiting for the other engines' reports",
        kind="wait",
        evidence=lambda: {"reports": sum(p.exists() for p in want)},
    ):
        while not all(p.exists() for p in want):
            time.sleep(GATHER_POLL_S)
    reports = [json.loads(p.read_text())["totals"] for p in want]
    return [sum(column) for column in zip(*reports, strict=True)]
