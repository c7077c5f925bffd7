"""The drafts the evaluate stage measures: the trained one, and its untrained baseline.

The trained draft is the train stage's choice (train/checkpoints/best: the epoch with the
lowest validation loss), else its last epoch, else its furthest checkpoint.

The baseline is the very draft training started from: the same builder (train/model.py: build),
the same seed (train.seed, set just before building, as the trainer does), the same aux layers
(extract's data_config.json), vocabulary mapping (vocab/d2t, t2d) and verifier weights, so it
differs from the trained draft in exactly one thing, the training. It is saved in speculators'
format (config.json + model.safetensors), which vLLM loads like the trained checkpoint, and is
refused unless its tensors have the trained checkpoint's names and shapes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from eyas.workers.train import checkpoint

log = logging.getLogger("eyas.evaluate")

MODEL = checkpoint.MODEL


class DraftMissing(ValueError):
    """No draft to evaluate."""


def trained_draft(train_dir: Path) -> Path:
    root = train_dir / "checkpoints"
    best = checkpoint.best(root)
    if best is not None:
        return best.path
    found = checkpoint.all_checkpoints(root)
    epochs = [c for c in found if c.name.startswith("epoch-")]
    if epochs or found:
        return (epochs or found)[-1].path
    raise DraftMissing(
        f"{root}: no trained draft (no complete checkpoint); run the train stage first "
        '(put "train" before "evaluate" in the pipeline)'
    )


def shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(path / MODEL), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def build_baseline(
    trained: Path,
    dest: Path,
    *,
    target_path: str,
    extract_dir: Path,
    vocab_dir: Path,
    draft_vocab: int,
    num_layers: int,
    ttt_steps: int,
    seed: int,
    trust_remote_code: bool = False,
) -> Path:
    """Write the untrained draft to `dest` (atomically: a temp dir renamed into place)."""
    import torch

    from eyas.workers.train import data as train_data
    from eyas.workers.train import model as train_model

    layout = train_data.read_layout(extract_dir)
    torch.manual_seed(seed)  # the trainer's initial draft (train/setup.py: Setup._model)
    model = train_model.build(
        target_path, layout.aux_ids, draft_vocab, num_layers, ttt_steps, vocab_dir, "sdpa", trust_remote_code
    )
    tmp = dest.with_name(f".tmp-{dest.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        want, got = shapes(trained), shapes(tmp)
        if want != got:
            diff = sorted(set(want.items()) ^ set(got.items()))[:3]
            raise ValueError(
                f"{trained}: the trained draft's tensors differ from an untrained draft built from this "
                f"run's config (first differences: {diff}); evaluate the run the draft was trained in"
            )
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    cfg = json.loads((dest / "config.json").read_text())
    log.info(
        "baseline: an untrained draft of the same shape (seed %d, aux layers %s) at %s",
        seed,
        cfg.get("eagle_aux_hidden_state_layer_ids"),
        dest,
    )
    return dest
