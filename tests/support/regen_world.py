"""What the regenerate tests share: a tiny llama target that answers like a chat model (its head fitted to the chats, so that it ends most answers with <|end|> and runs past max_tokens on others), a chat file, the run config of a regeneration, and readers of its outputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtoml import run_toml

from eyas.workers.models import assets

# Steps of fit_to_chats: enough for answers in the chats' words that end with <|end|> (fewer
# steps answer <|end|> alone), seconds on a CPU.
FIT_STEPS = 100
END = 2  # <|end|>: the tiny tokenizer's eos, and the template's end of turn (inside the mask)


def build_target(root: Path) -> Path:
    """The fitted tiny llama in `root`/llama (built once per test module)."""
    path = assets.build_model(root / "llama", "llama")
    assets.fit_to_chats(path, FIT_STEPS)
    return path


def chats(path: Path, n: int, seed: int = 3) -> Path:
    """`n` well-formed ShareGPT chats, one to three turns each (workers/models/assets.py)."""
    return assets.write_dataset(path, n=n, seed=seed, malformed=False)


def regen_toml(
    name: str,
    output_dir: Path,
    target: Path,
    data: Path,
    pipeline: list[str] | None = None,
    regenerate: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    preflight: bool = False,
    **tables: Any,
) -> str:
    """A run that prepares `data` and regenerates it on CPU (and whatever `pipeline` adds).
    Greedy, batches of 2 rows, 24 tokens per turn unless `regenerate` says otherwise."""
    stage = {"stall_timeout": 240, **({"options": options} if options else {})}
    return run_toml(
        name,
        pipeline or ["prepare", "regenerate"],
        output_dir=output_dir,
        preflight=preflight,
        target={"path": target, "dtype": "float32"},
        data={"path": data, "max_length": 160, "validation_fraction": 0.25},
        resources={"devices": "cpu"},
        regenerate={"batch_size": 2, "max_tokens": 24, **(regenerate or {})},
        draft={"vocab_size": 256},
        stages={"regenerate": stage, **tables.pop("stages", {})},
        **tables,
    )


def columns(stage_dir: Path) -> dict[str, list]:
    """A dataset folder's input_ids and loss_mask, row by row, as plain lists."""
    from datasets import load_from_disk

    ds = load_from_disk(str(stage_dir / "dataset")).with_format(None)
    return {name: [list(map(int, row)) for row in ds[name]] for name in ("input_ids", "loss_mask")}


def rows_lines(out: Path) -> list[dict]:
    """Every complete line of the rows files (a torn last line left out), as written."""
    found = []
    for path in sorted((out / "regenerate" / "rows").glob("rank-*.jsonl")):
        data = path.read_bytes()
        for line in data[: data.rfind(b"\n") + 1].splitlines():
            found.append(json.loads(line))
    return found
