"""What one training attempt is asked to do (Settings, resolved from the run config by stages/train.py) and the learning-rate schedule it follows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.workers.train import data as train_data


@dataclass(frozen=True)
class Settings:
    """What one training attempt needs, resolved from the run config (stages/train.py)."""

    target_path: str
    trust_remote_code: bool
    draft_vocab: int
    num_layers: int
    ttt_steps: int
    epochs: int
    lr: float
    batch_tokens: int
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    noise_std: float
    seed: int
    strategy: str  # "ddp" | "fsdp"
    device: str  # "cpu" | "cuda"
    prepare_dir: Path
    extract_dir: Path
    vocab_dir: Path
    out_dir: Path  # <output_dir>/train
    scheduler: str = "linear"  # "linear" | "cosine" | "constant"
    save_every: int = 0  # a mid-epoch checkpoint every N steps; 0: at epoch ends only
    log_every: int = 1
    num_workers: int = 0
    loss: str = "kl_div"
    loss_implementation: str = "eager"
    attn_impl: str = "sdpa"
    ttt_step_loss_decay: float = 1.0
    streaming: bool = False  # [storage] mode = "streaming": shards land while training runs (train/feed.py)

    @property
    def checkpoints(self) -> Path:
        return self.out_dir / "checkpoints"

    def identity(self, layout: train_data.Layout, world_size: int, n_train: int) -> dict[str, Any]:
        """What a checkpoint must share with this attempt to be resumed from: the model's shape,
        and everything the batch plan and the schedule depend on. (Not the strategy: DDP and
        FSDP checkpoints both hold full state dicts.)"""
        return {
            "target": str(Path(self.target_path).resolve()),
            "layer_ids": list(layout.layer_ids),
            "draft_vocab_size": self.draft_vocab,
            "num_layers": self.num_layers,
            "ttt_steps": self.ttt_steps,
            "epochs": self.epochs,
            "batch_tokens": self.batch_tokens,
            "seed": self.seed,
            "world_size": world_size,
            "train_rows": n_train,
        }


def make_scheduler(optimizer, kind: str, warmup: int, total: int):
    """Linear warmup to the base lr over `warmup` steps, then decay to 0 at `total` (linear or
    cosine, transformers' schedules as speculators uses them) or stay (constant)."""
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    warmup = min(warmup, max(total - 1, 0))
    if kind == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup, total)
    if kind == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, warmup, total)
    return get_constant_schedule_with_warmup(optimizer, warmup)
