"""The training loop around speculators' Eagle3DraftModel, on torch.distributed.

speculators' own Trainer assumes CUDA (docs/ARCHITECTURE.md, Engines on CPU), so this loop does what it does in the
same order, on any device: the model's forward computes the loss and the per-TTT-step
counts (speculators' compute_metrics); gradients are synchronised by DDP, or sharded by FSDP2
(speculators' apply_fully_sharded); metrics are summed across ranks with one all_reduce and
turned into ratios as speculators does (sum / total). Around it: AdamW, warmup then decay
(transformers' schedules, as speculators), gradient clipping, optional Gaussian noise on the
draft's input hidden states, validation before training and after every epoch, and
checkpoints that a retried attempt resumes from (workers/train/checkpoint.py).

Everything that decides which batch comes when is a pure function of the run's config
(workers/train/data.py: plan), and the noise of a step is drawn from a generator seeded by
(seed, step, rank): a resumed attempt replays exactly the steps an uninterrupted run makes.

The Trainer is one class in three modules, each a part of it read in the order it runs: its
setup (workers/train/setup.py: the data and its batch plans, the draft built and wrapped), its
checkpoints (workers/train/resume.py: resume, save), and here the run itself: the steps,
validation and the stage's summary. Its settings and schedule are workers/train/settings.py.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from eyas.workers.extract import stream
from eyas.workers.runtime import phases
from eyas.workers.runtime.cpu_share import share_cpus
from eyas.workers.runtime.dist import Dist
from eyas.workers.train import checkpoint
from eyas.workers.train import data as train_data
from eyas.workers.train.metrics import Meter, ratios
from eyas.workers.train.resume import Checkpointing, Position
from eyas.workers.train.settings import Settings, make_scheduler
from eyas.workers.train.setup import Setup

log = logging.getLogger("eyas.train")

MODEL_INPUTS = (
    "hidden_states",
    "input_ids",
    "document_ids",
    "loss_mask",
    "position_ids",
    "verifier_last_hidden_states",
)


class Trainer(Setup, Checkpointing):
    """One rank's training run: `run()` trains the draft and returns the stage's summary."""

    def __init__(self, ctx, s: Settings):
        self.ctx, self.s = ctx, s
        self.main = ctx.rank == 0
        self.progress = ctx.progress

    # -- steps -------------------------------------------------------------------------------

    def _inputs(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        # Only the model's inputs: its forward hands any other keyword to the decoder layers.
        return {k: batch[k].to(self.s.device, non_blocking=True) for k in MODEL_INPUTS}

    def _noise(self, hidden: torch.Tensor, global_step: int) -> torch.Tensor:
        s = self.s
        g = torch.Generator(device=hidden.device)
        # Seeded by (seed, step, rank), not carried along: resuming at any step redraws the same noise.
        g.manual_seed((s.seed * 1_000_003 + global_step) * 4099 + self.ctx.rank)
        return hidden + s.noise_std * torch.randn(hidden.shape, generator=g, device=hidden.device, dtype=hidden.dtype)

    def _forward(self, inputs: dict[str, torch.Tensor]):
        s = self.s
        kwargs = {
            "ttt_steps": s.ttt_steps,
            "ttt_step_loss_decay": s.ttt_step_loss_decay,
            "loss_config": self.loss_config,
        }
        if s.device == "cuda":
            with torch.autocast("cuda", dtype=self.hs_dtype):
                return self.model(**inputs, **kwargs)
        return self.model(**inputs, **kwargs)

    def _reduce(self, metrics: dict[str, torch.Tensor], extra: dict[str, float]) -> dict[str, float]:
        """Every rank's counts (and `extra`) summed with one all_reduce; the plain sums."""
        dev = self.s.device
        values = [metrics[k].detach().float().reshape(()).to(dev) for k in metrics] + [
            torch.tensor(float(v), device=dev) for v in extra.values()
        ]
        if not values:
            return {}
        sums = self.dist.all_reduce(torch.stack(values)).cpu()
        return dict(zip([*metrics, *extra], sums.tolist()))

    @torch.no_grad()
    def validate(self) -> dict[str, float] | None:
        if not self.val_plan:
            return None
        self.model.eval()
        if self.feed is not None:
            self.feed.wait(None, self.val_rows)
        acc: dict[str, torch.Tensor] = {}
        for batch in train_data.loader(
            self.val_set, self.val_plan, self.collate, self._workers(), self.s.device == "cuda"
        ):
            _, _, metrics = self._forward(self._inputs(batch))
            for k, v in metrics.items():
                acc[k] = acc[k] + v.detach().float() if k in acc else v.detach().float()
        self.model.train()
        return ratios(self._reduce(acc, {}), prefix="val_")

    def _workers(self) -> int:
        # Streaming loads in the loop: a prefetching worker would wait for shards out of sight
        # of the rank's heartbeat and of the feed's counts.
        return 0 if self.feed is not None else self.s.num_workers

    def _rows(self, batch: list[int]) -> list[int]:
        return [self.train_rows[j] for j in batch]

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        s, ctx = self.s, self.ctx
        if s.device == "cuda":
            torch.cuda.set_device(0 if torch.cuda.device_count() == 1 else ctx.local_rank)
        else:
            share_cpus(ctx.world_size, stream.sibling_ranks(ctx.config or {}, "train"))
        self.dist = Dist(ctx, s.device)
        done = False
        try:
            summary = self._run()
            done = True
            return summary
        finally:
            # The wrapped model goes before the group does (Dist.close says why); no barrier after
            # a failure, where the other ranks may be anywhere.
            self.dist.close(release=self._release, barrier=done)

    def _release(self) -> None:
        """Drop every reference to the wrapped model: the DDP Reducer or FSDP state must not outlive the group."""
        for name in ("model", "optimizer", "scheduler", "bare"):
            self.__dict__.pop(name, None)

    def _run(self) -> dict[str, Any]:
        from speculators.losses import resolve_loss_config
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar per checkpoint would litter the rank log

        s, ctx = self.s, self.ctx
        self._data()
        self.identity = s.identity(self.layout, ctx.world_size, self.n_train)
        self.loss_config = resolve_loss_config(s.loss, s.loss_implementation)
        with self.progress.beating(  # reads the target's embeddings and head
            "build draft model", kind="build", budget=phases.load_budget(s.target_path), evidence=phases.io_evidence
        ):
            self.bare = self._model()
        ckpt, pos = self._resume(self.bare)
        if self.feed is not None:
            self.feed.resume(pos.epoch, pos.step)
        self.model = self._wrap(self.bare)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, s.scheduler, s.warmup_steps, self.total_steps)
        if ckpt is not None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(
                self.model,
                self.optimizer,
                checkpoint.load_optimizer_state(ckpt),
                options=StateDictOptions(full_state_dict=True),
            )
            self.scheduler.load_state_dict(ckpt.state["scheduler"])

        samples_total = sum(len(b) for p in self.plans for b in p)
        tokens_total = sum(self._tokens(b) for p in self.plans for b in p)
        samples, tokens = self._done_before(pos.epoch, pos.step)
        self.progress.update(
            samples=samples, tokens=tokens, samples_total=samples_total, tokens_total=tokens_total, force=True
        )
        if ckpt is None:
            val = self.validate()
            if val is not None:
                pos.history.append({"step": 0, "epoch": 0.0, **val})
                self._report(val, step=0, force=True)
                if self.main:
                    log.info("step 0: validation loss %.4f, acc %s", val["val_loss"], self._accs(val, "val_"))

        self.model.train()
        meter = Meter()
        for epoch in range(pos.epoch, s.epochs):
            batches = self.plans[epoch]
            start = pos.step if epoch == pos.epoch else 0
            before = None
            if self.feed is not None:
                self.train_set.hs_dir = self.feed.dir_for(epoch)

                def before(k, epoch=epoch, start=start, batches=batches):
                    self.feed.wait(epoch, self._rows(batches[start + k]), step=start + k)

            loader = train_data.loader(
                self.train_set, batches[start:], self.collate, self._workers(), s.device == "cuda", before
            )
            meter.resume()
            for i, batch in enumerate(loader, start):
                n_tok = int((batch["document_ids"] != -1).sum())  # on the host: no device sync
                inputs = self._inputs(batch)
                metrics, grad_norm, lr = self._step(inputs, params, pos.global_step)
                pos.global_step += 1
                pos.epoch, pos.step = epoch, i + 1
                if self.feed is not None:
                    self.feed.used(epoch, i, self._rows(batches[i]))
                samples += len(batches[i])
                tokens += n_tok
                last = i + 1 == len(batches)
                if pos.global_step % s.log_every == 0 or last:
                    sums = self._reduce(metrics, {"tokens": n_tok})
                    dt = meter.elapsed()
                    vals = ratios(sums)
                    pos.train_loss = vals.get("loss")
                    grad = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
                    vals.update(
                        lr=lr,
                        grad_norm=grad,
                        step_tok_s=sums["tokens"] / dt if dt > 0 else 0.0,
                        epoch=epoch + (i + 1) / len(batches),
                    )
                    # The attempt's first step is always written: it shows where training (re)started.
                    self.progress.update(
                        samples=samples,
                        tokens=tokens,
                        force=meter.steps == 0,
                        **(dict(vals, step=pos.global_step) if self.main else {}),
                        **(self.feed.metrics() if self.feed is not None else {}),
                    )
                    if self.main:
                        log.info(
                            "epoch %d/%d step %d/%d (global %d/%d): loss %.4f acc %s lr %.2e grad %.3f %.0f tok/s",
                            epoch + 1,
                            s.epochs,
                            i + 1,
                            len(batches),
                            pos.global_step,
                            self.total_steps,
                            vals.get("loss", math.nan),
                            self._accs(vals),
                            lr,
                            grad,
                            vals["step_tok_s"],
                        )
                else:
                    self.progress.update(samples=samples, tokens=tokens)
                meter.step(n_tok)
                if s.save_every and pos.global_step % s.save_every == 0 and not last:
                    self._save(f"step-{pos.global_step}", pos)
                    meter.resume()  # saving is not training time
            pos.epoch, pos.step = epoch + 1, 0
            name = f"epoch-{epoch + 1}"
            val = self.validate()
            if val is not None:
                pos.history.append({"step": pos.global_step, "epoch": float(epoch + 1), **val})
                self._report(val, step=pos.global_step, force=True)
                if self.main:
                    log.info(
                        "epoch %d/%d: validation loss %.4f, acc %s",
                        epoch + 1,
                        s.epochs,
                        val["val_loss"],
                        self._accs(val, "val_"),
                    )
            if val is None or pos.best is None or val["val_loss"] < pos.best["val_loss"]:
                pos.best = {"name": name, "epoch": epoch + 1, "val_loss": val["val_loss"] if val is not None else None}
            self._save(name, pos)
            self.progress.update(samples=samples, tokens=tokens, force=True)

        if self.feed is not None:
            self.feed.done()
        return self._summary(ckpt, pos, meter)

    def _step(self, inputs: dict[str, torch.Tensor], params: list, global_step: int):
        """One optimisation step; (the model's metric counts, the gradient norm, the lr it used)."""
        s = self.s
        if s.noise_std > 0:
            inputs["hidden_states"] = self._noise(inputs["hidden_states"], global_step)
        _, loss, metrics = self._forward(inputs)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        return metrics, grad_norm, lr

    def _report(self, val: dict[str, float], step: int, force: bool = False) -> None:
        if self.main:
            self.progress.update(force=force, val_step=step, **val)

    def _accs(self, vals: dict[str, float], prefix: str = "") -> str:
        return "/".join(
            f"{vals[f'{prefix}acc_{k}']:.3f}" for k in range(self.s.ttt_steps) if f"{prefix}acc_{k}" in vals
        )

    def _summary(self, ckpt, pos: Position, meter: Meter) -> dict[str, Any]:
        s, ctx = self.s, self.ctx
        totals = self._reduce(
            {}, {"tokens": meter.tokens, "seconds": meter.seconds, "cpu": meter.cpu_seconds, "all": meter.all_tokens}
        )
        best = checkpoint.best(s.checkpoints)
        last = s.checkpoints / f"epoch-{s.epochs}"
        final_val = pos.history[-1] if pos.history else {}
        first_val = pos.history[0] if pos.history else {}
        chosen = best.path if best else last
        out = {
            "outputs": [str(chosen)] + ([str(last)] if chosen != last else []),
            "checkpoint": str(best.path if best else last),
            "best_checkpoint": best.name if best else None,
            "last_checkpoint": str(last),
            "epochs": s.epochs,
            "steps": pos.global_step,
            "steps_this_attempt": meter.steps,
            "resumed_from": ckpt.name if ckpt else None,
            "resumed_at_step": ckpt.global_step if ckpt else 0,
            "tokens_this_attempt": int(totals["all"]),
            # The group's steady training throughput: its tokens over the mean rank's time in the
            # training loop (data loading included; the attempt's first step, validation and
            # checkpoints left out).
            "tok_s": totals["tokens"] / (totals["seconds"] / ctx.world_size) if totals.get("seconds") else None,
            # The same tokens per CPU-second of the ranks: what other load on the host moves least.
            "tok_per_cpu_s": totals["tokens"] / totals["cpu"] if totals.get("cpu") else None,
            "loss": pos.train_loss,
            "val_loss": final_val.get("val_loss"),
            "val_loss_initial": first_val.get("val_loss"),
            **{k: v for k, v in final_val.items() if k.startswith(("val_acc_", "val_cond_acc_"))},
            "validation": pos.history,
            "train_rows": self.n_train,
            "validation_rows": self.n_val,
            # Summed over the ranks: each waits for, and frees, the shards of its own batches.
            **({"streaming": self.feed.stream.mode, **self._reduce({}, self.feed.metrics())} if self.feed else {}),
            "world_size": ctx.world_size,
            "strategy": s.strategy if ctx.world_size > 1 else "single",
            "device": s.device,
            "attention": s.attn_impl,
            "loss_fn": s.loss,
            "draft": {
                "vocab_size": s.draft_vocab,
                "num_layers": s.num_layers,
                "ttt_steps": s.ttt_steps,
                "aux_layer_ids": self.layout.aux_ids,
            },
        }
        return out
