"""The `train` stage: an EAGLE-3 draft trained on extract's hidden states, on every rank of the group.

Inputs (under the run's output dir): prepare/dataset + splits.json, extract/hidden_states +
data_config.json, vocab/d2t-<N>.npy + t2d-<N>.npy. Outputs, under <output_dir>/train/:
- checkpoints/epoch-<n>/   after each epoch: the draft in speculators' format (config.json,
                           model.safetensors; vLLM loads it as an eagle3 speculator) with
                           optimizer.safetensors and trainer_state.json beside it;
- checkpoints/step-<n>/    the newest mid-epoch checkpoint, when options.save_every is set;
- checkpoints/best         a link to the epoch with the lowest validation loss.
A retried attempt resumes from the furthest checkpoint (workers/train/checkpoint.py).

Run config: [draft] vocab_size, num_layers, ttt_steps; [train] epochs, lr, batch_tokens (the
packing budget per rank and step), warmup_steps, weight_decay, grad_clip, noise_std, seed,
strategy ("ddp" or "fsdp"). [stages.train.options], all optional (state/specs.py: TrainOptions):
- scheduler = "linear" | "cosine" | "constant"   decay after warmup (default linear, as speculators)
- save_every = N          a mid-epoch checkpoint every N steps (default 0: epoch ends only)
- log_every = N           reduce and report metrics every N steps (default 1)
- num_workers = N         data-loading processes (default 0 on CPU, 2 on CUDA)
- loss = "kl_div"         speculators' loss name or JSON weights, e.g. '{"ce": 0.1, "tv": 0.9}'
- loss_implementation     "eager" | "fused" (default: fused on CUDA with triton, else eager)
- attention               "sdpa" | "eager" | "simple_flex_attention" (default: sdpa on CPU,
                          speculators' flex attention on CUDA; flex has no CPU backward)
- ttt_step_loss_decay     the loss weight's decay per TTT step (default 1.0)
"""

from __future__ import annotations

import logging
from typing import Any

from eyas.state import contract
from eyas.state.regenerate import data_dir
from eyas.workers.runtime import atomic

log = logging.getLogger("eyas.train")


def _device(devices: Any) -> str:
    if devices == "cpu":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _fused_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def settings(ctx):
    """The attempt's Settings, from the run config in the rank context."""
    from eyas.state.runconfig import RunConfig, stage_options
    from eyas.workers.train.settings import Settings

    cfg = RunConfig.from_dict(ctx.config)
    if cfg.target is None:
        raise ValueError("train needs [target] in the run's config (the verifier the draft learns from); add it")
    # Checked when the run was submitted (state/specs.py: TrainOptions); what needs the device is checked here.
    opts = stage_options("train", ctx.options)
    device = _device(cfg.resources.devices)
    if device == "cpu" and opts.attention == "simple_flex_attention":
        raise ValueError('stages.train.options.attention: flex attention has no CPU backward; use "sdpa" on CPU')
    if opts.loss_implementation == "fused" and not _fused_available():
        raise ValueError(
            'stages.train.options.loss_implementation: "fused" needs triton, which is not installed; use "eager"'
        )
    out = ctx.output_dir
    return Settings(
        target_path=cfg.target.path,
        trust_remote_code=cfg.target.trust_remote_code,
        draft_vocab=cfg.draft.vocab_size,
        num_layers=cfg.draft.num_layers,
        ttt_steps=cfg.draft.ttt_steps,
        epochs=cfg.train.epochs,
        lr=cfg.train.lr,
        batch_tokens=cfg.train.batch_tokens,
        warmup_steps=cfg.train.warmup_steps,
        weight_decay=cfg.train.weight_decay,
        grad_clip=cfg.train.grad_clip,
        noise_std=cfg.train.noise_std,
        seed=cfg.train.seed,
        strategy=cfg.train.strategy,
        device=device,
        prepare_dir=data_dir(out, cfg.pipeline),  # prepare's dataset, or regenerate's
        extract_dir=out / "extract",
        vocab_dir=out / "vocab",
        out_dir=ctx.stage_dir,
        scheduler=opts.scheduler,
        save_every=opts.save_every,
        log_every=opts.log_every,
        num_workers=(2 if device == "cuda" else 0) if opts.num_workers is None else opts.num_workers,
        loss=opts.loss,
        loss_implementation=opts.loss_implementation
        or ("fused" if device == "cuda" and _fused_available() else "eager"),
        attn_impl=opts.attention or ("simple_flex_attention" if device == "cuda" else "sdpa"),
        ttt_step_loss_decay=opts.ttt_step_loss_decay,
        streaming=cfg.storage.mode == "streaming",
    )


def main(ctx) -> None:
    from eyas.state.executiontables import ResourcesConfig

    if ResourcesConfig.model_validate((ctx.config or {}).get("resources") or {}).devices == "cpu":
        from eyas.workers.runtime.cpu_share import passive_waits

        passive_waits()  # before settings() loads torch (eyas.workers.train's modules import it)
    s = settings(ctx)
    from eyas.workers.train.loop import Trainer

    summary = Trainer(ctx, s).run()
    if ctx.rank == 0:
        log.info("train: done; draft at %s", summary["checkpoint"])
        atomic.write_json(ctx.attempt_dir / contract.SUMMARY, summary)
