"""Where a training run stands (Position), resumed from the latest checkpoint at an attempt's start and saved into a new one at each epoch's end (and every `save_every` steps).

A mixin of Trainer (workers/train/loop.py), read with it: its methods use the trainer's
settings, `dist`, `identity`, model, optimizer and scheduler; the files are
workers/train/checkpoint.py's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from eyas.workers.runtime import phases
from eyas.workers.train import checkpoint
from eyas.workers.train import model as train_model

log = logging.getLogger("eyas.train")


@dataclass
class Position:
    """Where a run stands: the next batch, the validations so far, the best checkpoint."""

    epoch: int = 0  # the epoch to run next (0-based)
    step: int = 0  # batches of that epoch already done
    global_step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # validations
    best: dict[str, Any] | None = None
    train_loss: float | None = None


class Checkpointing:
    """Trainer's checkpoints: `_resume` from the latest at an attempt's start, `_save` a new one."""

    def _resume(self, model) -> tuple[checkpoint.Checkpoint | None, Position]:
        s = self.s
        if self.main:
            removed = checkpoint.clean(s.checkpoints)
            if removed:
                log.info("removed %d partial checkpoint(s) left by an interrupted save", removed)
        self.dist.barrier()  # nobody looks before the leftovers are gone
        ckpt = checkpoint.latest(s.checkpoints)
        if ckpt is None:
            return None, Position()
        identity = self.identity
        saved = ckpt.state.get("identity") or {}
        for key in sorted(identity):
            if saved.get(key) != identity[key]:
                raise checkpoint.CheckpointError(
                    f"{ckpt.path} was written by another training setup ({key}: {saved.get(key)!r} there, "
                    f"{identity[key]!r} now); delete {s.checkpoints} to start over, or set another output_dir"
                )
        missing, unexpected = model.load_state_dict(checkpoint.load_model_state(ckpt), strict=False)
        missing = set(missing) - train_model.frozen_keys(model)
        if missing or unexpected:
            raise checkpoint.CheckpointError(
                f"{ckpt.path / checkpoint.MODEL}: missing {sorted(missing)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]}; delete it to start over"
            )
        st = ckpt.state
        pos = Position(
            epoch=int(st["next_epoch"]),
            step=int(st["next_step"]),
            global_step=int(st["global_step"]),
            history=list(st.get("validation") or []),
            best=st.get("best"),
            train_loss=st.get("train_loss"),
        )
        if self.main:
            log.info(
                "resuming from %s: epoch %d, step %d of it, global step %d of %d",
                ckpt.name,
                pos.epoch + 1,
                pos.step,
                pos.global_step,
                self.total_steps,
            )
            best = checkpoint.best(s.checkpoints)
            if pos.best and (best is None or best.name != pos.best["name"]):
                # Killed between a save and its link: the trainer state knows which one is best.
                checkpoint.set_best(s.checkpoints, pos.best["name"])
        return ckpt, pos

    def _state_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # Full (unsharded) dicts, gathered on rank 0 in host memory; without a group there is
        # nothing to gather.
        return StateDictOptions(full_state_dict=True, cpu_offload=self.dist.active)

    def _save(self, name: str, pos: Position) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        # Gathering full state dicts and writing them: silent for minutes with a large draft.
        with self.progress.beating(
            f"checkpoint {name}",
            kind="checkpoint",
            budget=phases.save_budget(3 * sum(p.numel() * p.element_size() for p in self.model.parameters())),
            evidence=phases.io_evidence,
        ):  # weights and the optimizer's two moments
            opts = self._state_options()
            msd = get_model_state_dict(self.model, options=opts)  # collective under FSDP
            osd = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
            if self.main:
                t0 = time.monotonic()
                state = {
                    "name": name,
                    "next_epoch": pos.epoch,
                    "next_step": pos.step,
                    "global_step": pos.global_step,
                    "total_steps": self.total_steps,
                    "epochs": self.s.epochs,
                    "identity": self.identity,
                    "scheduler": self.scheduler.state_dict(),
                    "validation": pos.history,
                    "best": pos.best,
                    "train_loss": pos.train_loss,
                    "time": time.time(),
                    "rng": {
                        "noise": "normal, from a torch.Generator seeded by (seed, global_step, rank)",
                        "seed": self.s.seed,
                        "noise_std": self.s.noise_std,
                    },
                }
                path = checkpoint.save(self.s.checkpoints, name, self.bare, msd, osd, state)
                if pos.best and pos.best.get("name") == name:
                    checkpoint.set_best(self.s.checkpoints, name)
                pruned = checkpoint.prune_steps(self.s.checkpoints, keep=name)
                log.info(
                    "checkpoint %s saved in %.1fs%s",
                    path,
                    time.monotonic() - t0,
                    f" (removed {', '.join(pruned)})" if pruned else "",
                )
        self.dist.barrier()
