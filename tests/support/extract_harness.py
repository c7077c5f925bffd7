"""Run the extract stage in-process on the hf backend, on prepare-shaped datasets of real token ids, and fingerprint what it wrote."""

from __future__ import annotations

import hashlib
import random
import time
from pathlib import Path

from daemon_harness import daemon, wait_for  # noqa: F401 (fixture)
from rank_context import rank_context

from eyas.workers.models import assets
from eyas.workers.runtime.rank import RankContext
from eyas.workers.stages import extract


def token_rows(tokenizer_dir: Path, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Real token ids of the tiny tokenizer, cut into samples of the given lengths."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = " ".join(t["value"] for c in assets.conversations(400, seed) for t in c["conversations"])
    ids = tok(text)["input_ids"]
    rng = random.Random(seed)
    rows = []
    for n in lengths:
        start = rng.randrange(len(ids) - n)
        rows.append(ids[start : start + n])
    return rows


def write_dataset(output_dir: Path, rows: list[list[int]]) -> Path:
    """prepare's output, as speculators' prepare-data writes it (torch format)."""
    import datasets

    ds = datasets.Dataset.from_dict(
        {"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows], "seq_len": [len(r) for r in rows]}
    )
    ds.set_format("torch")
    path = output_dir / "prepare" / "dataset"
    ds.save_to_disk(str(path))
    return path


def context(
    output_dir: Path,
    target: Path,
    dtype="float32",
    layer_ids=None,
    batch_size=4,
    rank=0,
    world_size=1,
    trust_remote_code=False,
) -> RankContext:
    attempt_dir = output_dir.parent / f"attempt-{rank}-{time.monotonic_ns()}"
    attempt_dir.mkdir(parents=True)
    config = {
        "target": {"path": str(target), "dtype": dtype, "trust_remote_code": trust_remote_code},
        "extract": {"backend": "hf", "layer_ids": layer_ids, "tensor_parallel_size": 1, "batch_size": batch_size},
        "resources": {"ranks": world_size, "devices": "cpu"},
    }
    return rank_context(
        "extract", attempt_dir, output_dir, config, rank=rank, world_size=world_size, progress_interval=0
    )


def run_stage(output_dir: Path, target: Path, **kw) -> RankContext:
    ctx = context(output_dir, target, **kw)
    try:
        extract.main(ctx)
    finally:
        ctx.progress.close()
    return ctx


def sha256s(extract_dir: Path) -> dict[str, str]:
    files = sorted((extract_dir / "hidden_states").glob("hs_*.safetensors")) + [extract_dir / "data_config.json"]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
