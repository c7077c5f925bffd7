"""`eyas validate CONFIG`: check a run config without submitting it.

Prints what the run would do (pipeline, layer ids and what they mean, ranks per stage, the
optimizer steps of training), or every mistake on stderr with exit code 2: the config's own
(state/runconfig.py), then what `eyas submit` refuses of its target (state/preload.py: weights on
disk, TP against its shape). A valid config whose training would take fewer than
state/trainsteps.py's MIN_STEPS optimizer steps gets a WARN line on stderr, exit code still 0.
Needs no daemon, and no torch.
"""

from __future__ import annotations

import sys

from eyas.state import trainsteps
from eyas.state.preload import lines, loaders
from eyas.state.regenerate import data_stage
from eyas.state.runconfig import ConfigError, RunConfig, load, stage_world_size
from eyas.state.target import num_hidden_layers


def layer_meaning(layer_id: int, n: int) -> str:
    """What hidden state a layer id names (vLLM / speculators convention, docs/ARCHITECTURE.md)."""
    if layer_id == 0:
        return "embeddings"
    if layer_id == n:
        return "final pre-norm output"
    return f"entering layer {layer_id}"


def train_steps(cfg: RunConfig, name: str) -> tuple[str | None, str | None]:
    """(the summary's row on training's optimizer steps, a WARN line when they are fewer than
    MIN_STEPS); (None, None) without a train stage or rows to count."""
    from eyas.cli import datasize

    if "train" not in cfg.pipeline:
        return None, None
    found = datasize.lengths_for(cfg)
    if found is None or not found.train:
        return None, None
    tr, world = cfg.train, stage_world_size(cfg, "train")
    steps = trainsteps.total_steps(found.train, tr.batch_tokens, world, tr.epochs, tr.seed)
    per_epoch = trainsteps.epoch_steps(found.train, tr.batch_tokens, world, tr.seed)
    ranks = f"{world} rank{'s' if world != 1 else ''}"
    counted = f"{len(found.train)} training rows of ~{sum(found.train)} tokens, {found.source}"
    row = f"~{steps} optimizer steps: {tr.epochs} epochs × ~{per_epoch} of batch_tokens {tr.batch_tokens} on {ranks}"
    row += f" (packed as training packs them; {counted})"
    if steps >= trainsteps.MIN_STEPS:
        return row, None
    sized = trainsteps.size(found.train, world, tr.seed)
    warn = (
        f"{name}: WARN train: ~{steps} optimizer steps ({tr.epochs} epochs × ~{per_epoch} of train.batch_tokens "
        f"{tr.batch_tokens} on {ranks}; {counted}), fewer than the {trainsteps.MIN_STEPS} a draft needs to learn"
    )
    if (sized.batch_tokens, sized.epochs) != (tr.batch_tokens, tr.epochs):
        warn += (
            f"; lower train.batch_tokens or raise train.epochs: train.batch_tokens = {sized.batch_tokens}, "
            f"train.epochs = {sized.epochs}, train.lr = {sized.lr:g} and train.warmup_steps = "
            f"{sized.warmup_steps} make ~{sized.total_steps} steps (eyas init sizes them so; docs/configuration.md, "
            '"Sizing training to the data")'
        )
    if sized.too_small:
        warn += (
            f"; the data is too small for a useful draft: {sized.why}; about "
            f"{trainsteps.too_small_tokens(world, sized.batch_tokens)} training tokens or more reach "
            f"{trainsteps.MIN_STEPS} steps within {trainsteps.MAX_EPOCHS} epochs: add data"
        )
    return row, warn


def summary(cfg: RunConfig, steps: str | None = None) -> list[str]:
    rows = [("name", cfg.name), ("pipeline", " -> ".join(cfg.pipeline))]
    n = None
    if cfg.target is not None:
        n = num_hidden_layers(cfg.target.path)
        remote = ", trust_remote_code" if cfg.target.trust_remote_code else ""
        rows.append(("target", f"{cfg.target.path} ({n} layers, {cfg.target.dtype}{remote})"))
    if cfg.data is not None:
        rows.append(("data", f"{cfg.data.path} ({cfg.data.format}, max_length {cfg.data.max_length})"))
    if "extract" in cfg.pipeline:
        ex = cfg.extract
        dummy = ", dummy weights" if any(ld.stage == "extract" and ld.dummy for ld in loaders(cfg)) else ""
        rows.append(
            ("extract", f"{ex.backend}, tensor parallel {ex.tensor_parallel_size}, batch {ex.batch_size}{dummy}")
        )
    if cfg.extract.layer_ids is not None:
        ids = cfg.extract.layer_ids
        rows.append(("layer ids", ", ".join(f"{i} ({layer_meaning(i, n)})" if n is not None else str(i) for i in ids)))
    if "evaluate" in cfg.pipeline:
        ev = cfg.evaluate
        # Without a prompt file: the validation rows of the dataset the run trains on.
        prompts = ev.prompts or f"{data_stage(cfg.pipeline)}'s validation rows"
        limit = f"up to {ev.max_prompts}" if ev.max_prompts else "all"
        rows.append(
            (
                "evaluate",
                f"vLLM, {ev.num_speculative_tokens} draft tokens, tensor parallel "
                f"{ev.tensor_parallel_size}, {limit} prompts from {prompts}, "
                f"{ev.max_tokens} tokens each",
            )
        )
    if steps is not None:
        rows.append(("train", steps))
    rows.append(("ranks", ", ".join(f"{s} {stage_world_size(cfg, s)}" for s in cfg.pipeline)))
    devices = cfg.resources.devices
    rows.append(("devices", devices if isinstance(devices, str) else ", ".join(map(str, devices))))
    rows.append(("output", cfg.output_dir or "chosen by the daemon (<state>/runs/<id>/out)"))
    width = max(len(k) for k, _ in rows)
    return [f"  {k.ljust(width)}  {v}" for k, v in rows]


def command(args) -> int:
    try:
        cfg = load(args.config)
    except ConfigError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 2
    # What `eyas submit` refuses of the target too: its weights on disk, TP against its shape.
    refused = lines(cfg, str(args.config))
    if refused:
        for line in refused:
            print(line, file=sys.stderr)
        return 2
    steps, warn = train_steps(cfg, str(args.config))
    print(f"{args.config}: valid")
    for line in summary(cfg, steps):
        print(line)
    if warn is not None:
        print(warn, file=sys.stderr)
    return 0
