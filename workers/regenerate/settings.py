"""What one regenerate rank runs with: the run's [regenerate], [target] and [data] resolved (the stop tokens, the context), its batch plan, and the identity its rows are bound to.

The plan is a pure function of the dataset's row count and batch_size: the rows in order, cut
into batches, and each rank's share dealt as extract deals its batches (state/slurm.py:
node_batches, each batch whole on one engine). A retried attempt therefore recomputes exactly
the batches an uninterrupted run computes, and skips those already in the rows files.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eyas.state.regenerate import tensor_parallel_size
from eyas.state.runconfig import RunConfig, stage_options
from eyas.state.slurm import node_batches
from eyas.state.target import read_model_config, text_value

SOURCE = "prepare"  # the stage whose dataset is regenerated


@dataclass(frozen=True)
class Settings:
    target_path: str
    dtype: str
    trust_remote_code: bool
    source_dir: Path  # <output_dir>/prepare
    out_dir: Path  # <output_dir>/regenerate
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    batch_size: int
    turns: str
    tensor_parallel_size: int
    stop_token_ids: tuple[int, ...]  # the target's eos ids and [regenerate] stop_token_ids
    max_length: int  # data.max_length
    context: int  # the engine's max_model_len
    vllm_options: dict
    canary: bool = True

    @classmethod
    def from_context(cls, ctx) -> Settings:
        return cls.from_config(ctx.config or {}, ctx.options or {}, Path(ctx.output_dir))

    @classmethod
    def from_config(cls, config: dict, options: dict, output_dir: Path) -> Settings:
        cfg = RunConfig.from_dict(config)
        if cfg.target is None or cfg.data is None:
            raise ValueError("regenerate needs [target] and [data] in the run's config; add both tables")
        rg = cfg.regenerate
        vllm = dict(stage_options("regenerate", options).vllm)  # checked when the run was submitted
        model_cfg = read_model_config(cfg.target.path)
        own = vllm.get("max_model_len")
        context = int(own) if own else default_context(cfg.data.max_length, model_cfg)
        return cls(
            target_path=cfg.target.path,
            dtype=cfg.target.dtype,
            trust_remote_code=cfg.target.trust_remote_code,
            source_dir=output_dir / SOURCE,
            out_dir=output_dir / "regenerate",
            temperature=rg.temperature,
            top_p=rg.top_p,
            max_tokens=rg.max_tokens,
            seed=rg.seed,
            batch_size=rg.batch_size,
            turns=rg.turns,
            tensor_parallel_size=tensor_parallel_size(cfg.to_dict()),
            stop_token_ids=tuple(sorted({*eos_ids(cfg.target.path, model_cfg), *(rg.stop_token_ids or ())})),
            max_length=cfg.data.max_length,
            context=context,
            vllm_options=vllm,
            canary=rg.canary,
        )

    def sampling(self) -> dict[str, Any]:
        """What the answers depend on besides the target and the data (recorded, and compared on resume)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "turns": self.turns,
            "stop_token_ids": list(self.stop_token_ids),
            "max_length": self.max_length,
            "max_model_len": self.context,
            "batch_size": self.batch_size,
        }

    def identity(self, dataset_digest: str) -> dict[str, Any]:
        """What a regenerate/rows folder is bound to (ledger.claim): whose answers, to which rows, how drawn.
        Not the TP size nor the world size: a retry may change them (last bits may then differ)."""
        return {
            "model": str(Path(self.target_path).resolve()),
            "dtype": self.dtype,
            "dataset": dataset_digest,
            **self.sampling(),
            # Prefix caching makes a batch's numbers depend on the batches before it.
            "prefix_caching": bool(self.vllm_options.get("enable_prefix_caching", False)),
        }

    def as_json(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


def default_context(max_length: int, model_cfg: dict) -> int:
    """The engine's max_model_len unless the options set one: data.max_length (no row grows past
    it), within the target's max_position_embeddings."""
    positions = text_value(model_cfg, "max_position_embeddings")
    return min(max_length, int(positions)) if isinstance(positions, int) and positions > 0 else max_length


def eos_ids(target_path: str, model_cfg: dict) -> list[int]:
    """The target's end-of-sequence ids: generation_config.json's eos_token_id (an id or a list,
    what vLLM stops at), and config.json's."""
    found: list[int] = []
    for value in (_generation_eos(target_path), text_value(model_cfg, "eos_token_id")):
        items = value if isinstance(value, list) else [value]
        found += [v for v in items if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    return sorted(set(found))


def _generation_eos(target_path: str) -> Any:
    path = Path(target_path) / "generation_config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None


def plan_batches(n_rows: int, batch_size: int) -> list[list[int]]:
    """Every batch of the one plan: the rows in order, `batch_size` at a time."""
    if batch_size < 1:
        raise ValueError(f"regenerate.batch_size = {batch_size}: use 1 or more")
    return [list(range(k, min(k + batch_size, n_rows))) for k in range(0, n_rows, batch_size)]


def share(plan: list[list[int]], lengths, rank: int, world_size: int) -> list[int]:
    """The indices (into `plan`) of rank `rank`'s batches: all for one engine, else its deal by
    tokens (node_batches), each batch whole on one engine."""
    if world_size == 1:
        return list(range(len(plan)))
    mine = node_batches(plan, lengths, rank, world_size)
    index = {tuple(b): i for i, b in enumerate(plan)}
    return [index[tuple(b)] for b in mine]
