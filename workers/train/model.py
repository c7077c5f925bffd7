"""Build the EAGLE-3 draft with speculators, as `speculators train` builds it by default.

The decoder config is speculators' own derivation from the verifier
(speculators.train.cli.create_transformer_layer_config: a Llama decoder with the verifier's
hidden size, heads, rope and norm eps); the model is Eagle3DraftModel.from_training_args with
the eagle3 defaults of speculators' CLI (norm_before_residual, norm_before_fc and norm_output
on). The verifier's embeddings, lm_head rows of the draft vocabulary and final norm are
loaded from the target by speculators (load_verifier_weights); d2t/t2d come from the vocab stage.

One deliberate difference: every draft layer uses full attention. speculators defaults to a
2048-token sliding window; full attention is what EAGLE-3 heads use at serving time, so that
training and vLLM agree at every sequence length.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

log = logging.getLogger("eyas.train")


class DraftError(ValueError):
    """The draft cannot be built from these inputs."""


def load_vocab(vocab_dir: Path, draft_vocab: int, target_vocab: int):
    """(d2t, t2d) tensors of the vocab stage, checked against the run; (None, None) when the
    draft keeps the whole target vocabulary (speculators then maps nothing)."""
    import torch

    d2t_path, t2d_path = vocab_dir / f"d2t-{draft_vocab}.npy", vocab_dir / f"t2d-{draft_vocab}.npy"
    if draft_vocab == target_vocab:
        return None, None
    if not (d2t_path.exists() and t2d_path.exists()):
        raise DraftError(
            f"{d2t_path.parent}: no d2t-{draft_vocab}.npy / t2d-{draft_vocab}.npy; run the vocab stage "
            'first (put "vocab" before "train" in the pipeline)'
        )
    d2t = np.load(d2t_path, allow_pickle=False)
    t2d = np.load(t2d_path, allow_pickle=False)
    if d2t.shape != (draft_vocab,) or t2d.shape != (target_vocab,) or int(t2d.sum()) != draft_vocab:
        raise DraftError(
            f"{d2t_path.parent}: the mapping (d2t {d2t.shape}, t2d {t2d.shape} marking {int(t2d.sum())}) "
            f"does not fit draft.vocab_size {draft_vocab} and the target's {target_vocab} tokens; "
            "rerun the vocab stage"
        )
    return torch.from_numpy(d2t.astype(np.int64)), torch.from_numpy(t2d.astype(bool))


def build(
    target_path: str,
    aux_layer_ids: list[int],
    draft_vocab: int,
    num_layers: int,
    ttt_steps: int,
    vocab_dir: Path,
    attn_impl: str,
    trust_remote_code: bool = False,
):
    """A fresh Eagle3DraftModel on the CPU (float32 master weights), verifier weights loaded."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.utils import get_verifier_config
    from speculators.train.cli import create_transformer_layer_config

    verifier = get_verifier_config(target_path, trust_remote_code=trust_remote_code)
    d2t, t2d = load_vocab(vocab_dir, draft_vocab, verifier.vocab_size)
    layer_config = create_transformer_layer_config(
        target_path,
        num_layers=num_layers,
        draft_arch="llama",
        hidden_act="silu",
        sliding_window=2048,
        full_attention_indices=list(range(num_layers)),
        trust_remote_code=trust_remote_code,
    )
    model = Eagle3DraftModel.from_training_args(
        layer_config,
        t2d=t2d,
        d2t=d2t,
        draft_vocab_size=draft_vocab,
        norm_before_residual=True,
        norm_before_fc=True,
        norm_output=True,
        fc_norm=False,
        embed_requires_grad=False,
        ttt_steps=ttt_steps,
        verifier_name_or_path=target_path,
        target_layer_ids=list(aux_layer_ids),
        draft_attn_impl=attn_impl,
        trust_remote_code=trust_remote_code,
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info(
        "draft: %d layer(s), %d trainable parameters, draft vocab %d of %d, aux layers %s, attention %s",
        num_layers,
        trainable,
        draft_vocab,
        verifier.vocab_size,
        list(aux_layer_ids),
        attn_impl,
    )
    return model


def frozen_keys(model) -> set[str]:
    """Keys a checkpoint may lack: speculators never saves the verifier's lm_head and norm,
    which `build` loads from the target again."""
    return {k for k in model.state_dict() if k.startswith(("verifier_lm_head.", "verifier_norm."))}
