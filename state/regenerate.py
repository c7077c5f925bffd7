"""The regenerate stage's part of the run model: its `[regenerate]` table, where it may sit in a pipeline, and which data directory a run's later stages read.

`regenerate` (workers/stages/regenerate.py) has the target answer the prepared prompts again and
writes a dataset laid out as prepare's (`<output_dir>/regenerate/`: dataset/, splits.json,
token_freq.npy, summary.json). A run whose pipeline has it trains on the target's own answers:
every stage after it (extract, vocab, train, evaluate, the streaming plan) reads
`data_dir(output_dir, pipeline)`, the one answer to "which data does this run read", so that none
of them knows which stage wrote it.

Pure data and stdlib + pydantic, like the rest of eyas.state: the daemon and `eyas validate`
import it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from eyas.state.specs import Table
from eyas.state.tomlcheck import Report, describe

STAGE = "regenerate"
# The stages whose output is a dataset the later stages read, in the order they write it.
DATA_STAGES = ("prepare", STAGE)
# What reads the dataset (or what is counted from it): these must come after regenerate.
READERS = ("extract", "vocab", "train", "evaluate")
Turns = Literal["all", "last"]


class RegenerateConfig(Table):
    """[regenerate]: how the target rewrites the dataset's assistant turns (workers/regenerate/)."""

    temperature: float = Field(0.0, ge=0, le=10, description="Sampling temperature of the answers; 0: greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling's probability mass; 1: off.")
    max_tokens: int = Field(
        1024,
        ge=1,
        le=1_048_576,
        description="Tokens per regenerated turn at most; a row never grows past `data.max_length` either.",
    )
    seed: int = Field(
        0,
        ge=0,
        le=2**31 - 1,
        description="With a temperature, each request's seed comes from (seed, row, turn), so a resumed batch "
        "samples what the interrupted one would have.",
    )
    batch_size: int = Field(
        256,
        ge=1,
        le=65536,
        description="Rows generated together, written whole and resumed: the unit of a retry's resume, and "
        "the most sequences in flight (each turn of a batch waits for its slowest answer). Below vLLM's "
        "`max_num_seqs` (256; 1024 on H100/H200) the engine idles: 64 ran at a third to a half of a plain "
        "vLLM generate's throughput (tests/bench/bench_regenerate.py).",
    )
    # None: extract.tensor_parallel_size (tensor_parallel_size() below).
    tensor_parallel_size: int | None = Field(
        None, ge=1, description="Tensor-parallel size of each engine (one per rank); unset: extract's."
    )
    turns: Turns = Field(
        "all",
        description="`all`: every assistant turn, each on the regenerated turns before it; `last`: the last "
        "one only, the earlier turns kept as the data has them, as context.",
    )
    # TOML arrays arrive as lists: strict=False lets them become the tuple (the items stay strict).
    stop_token_ids: tuple[Annotated[int, Field(ge=0)], ...] | None = Field(
        None,
        strict=False,
        description="More token ids that end a turn, beside the target's `eos_token_id` "
        "(generation_config.json, config.json).",
    )
    canary: bool = Field(
        True,
        description="Run the generation's canary in preflight: a few short answers through the same engine "
        "on a shrunken, dummy-weight copy of the target.",
    )


def data_stage(pipeline: Sequence[str] | None) -> str:
    """The stage whose dataset a run's later stages read: regenerate's when the pipeline has it."""
    return STAGE if STAGE in (pipeline or ()) else "prepare"


def data_dir(output_dir: str | Path, pipeline: Sequence[str] | None) -> Path:
    """<output_dir>/prepare or <output_dir>/regenerate: dataset/, splits.json, token_freq.npy."""
    return Path(output_dir) / data_stage(pipeline)


def pipeline_problems(pipeline: Sequence[str]) -> list[str]:
    """regenerate's place: after prepare (it reads prepare's dataset), before what reads its own."""
    if STAGE not in pipeline:
        return []
    at = list(pipeline).index(STAGE)
    problems = []
    if "prepare" in pipeline and list(pipeline).index("prepare") > at:
        problems.append("regenerate comes before prepare, whose dataset it rewrites; put prepare first")
    early = [s for s in READERS if s in pipeline and list(pipeline).index(s) < at]
    if early:
        fixed = [s for s in pipeline if s != STAGE]
        fixed.insert(min(fixed.index(s) for s in early), STAGE)
        problems.append(
            f"regenerate comes after {', '.join(early)}, which {'reads' if len(early) == 1 else 'read'} "
            f"its dataset; e.g. pipeline = {json.dumps(fixed)}"
        )
    return problems


def tensor_parallel_size(cfg: dict) -> int:
    """The TP size of a run's regenerate engines (its config's dict form): its own, else extract's."""
    own = (cfg.get(STAGE) or {}).get("tensor_parallel_size")
    return int(own or (cfg.get("extract") or {}).get("tensor_parallel_size") or 1)


def check(report: Report, data: dict, pipeline: Sequence[str], devices: Any) -> RegenerateConfig:
    """The file's [regenerate] table (its defaults when absent), its tensor_parallel_size checked
    against resources.devices when the pipeline runs it (extract's, its default, is checked there)."""
    cfg = RegenerateConfig()
    if STAGE in data:
        if not isinstance(data[STAGE], dict):
            report.error(STAGE, f"expected a table, got {describe(data[STAGE])}; write it as [{STAGE}]")
        else:
            cfg = report.table(RegenerateConfig, data[STAGE], f"{STAGE}.") or RegenerateConfig()
    if cfg.stop_token_ids == ():
        report.error(f"{STAGE}.stop_token_ids", "empty; list the ids that end a turn, or remove the key")
    tp = cfg.tensor_parallel_size
    if tp is not None and STAGE in pipeline and isinstance(devices, tuple) and tp > len(devices):
        report.error(
            f"{STAGE}.tensor_parallel_size",
            f"{tp} needs {tp} GPUs but resources.devices lists {len(devices)}; list {tp} devices or lower it",
        )
    return cfg
