"""A RankContext for one rank run in the test's own process, as the rank runtime builds it from the rank contract's environment."""

from __future__ import annotations

from pathlib import Path

from eyas.workers.runtime.progress import ProgressWriter
from eyas.workers.runtime.rank import RankContext


def rank_context(
    stage: str,
    attempt_dir: Path,
    output_dir: Path,
    config: dict,
    *,
    rank: int = 0,
    world_size: int = 1,
    attempt: int = 1,
    run_id: int | None = None,
    master_port: int = 0,
    options: dict | None = None,
    progress_interval: float | None = None,
) -> RankContext:
    """`progress_interval`: the progress writer's throttle (None: its default)."""
    throttle = {} if progress_interval is None else {"min_interval": progress_interval}
    return RankContext(
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        master_addr="127.0.0.1",
        master_port=master_port,
        run_id=run_id,
        stage=stage,
        attempt=attempt,
        attempt_dir=attempt_dir,
        output_dir=output_dir,
        config=config,
        options=dict(options or {}),
        progress=ProgressWriter(attempt_dir / f"rank-{rank}.progress.jsonl", **throttle),
    )
