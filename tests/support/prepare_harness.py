"""Run the prepare stage in-process as the rank runtime would, and write the datasets its tests feed it."""

from __future__ import annotations

import json
from pathlib import Path

from daemon_harness import daemon  # noqa: F401 (fixture)
from rank_context import rank_context

from eyas.workers.stages import prepare


def run_prepare(cfg: dict, out: Path, attempt: int = 1) -> dict:
    """Run the stage's entry point as the rank runtime would; return its summary.json."""
    attempt_dir = out / "attempts" / f"attempt-{attempt}"
    attempt_dir.mkdir(parents=True, exist_ok=True)
    ctx = rank_context("prepare", attempt_dir, out, cfg, attempt=attempt, run_id=1, master_port=29500)
    try:
        prepare.main(ctx)
    finally:
        ctx.progress.close()
    return json.loads((attempt_dir / "summary.json").read_text())


def write_huge_line_dataset(path: Path, good: list[dict], huge_bytes: int) -> None:
    """Good rows around one chat row of `huge_bytes` bytes, written a repeated chunk at a time."""
    head = b'{"messages": [{"role": "user", "content": "'
    tail = b'"}, {"role": "assistant", "content": "ok"}]}\n'
    chunk = b"lorem ipsum dolor sit amet " * (2**20 // 27)
    with open(path, "wb") as f:
        f.write(b"".join(json.dumps(r).encode() + b"\n" for r in good[:2]))
        f.write(head)
        left = huge_bytes - len(head) - len(tail)
        while left > 0:
            f.write(chunk[:left])
            left -= len(chunk)
        f.write(tail)
        f.write(b"".join(json.dumps(r).encode() + b"\n" for r in good[2:]))
