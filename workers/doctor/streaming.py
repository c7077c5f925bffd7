"""The doctor's check of a streaming run's GPU memory ([storage] mode = "streaming"): where the daemon puts train's ranks beside extract's, the extractor's share of a card plus one training rank must fit that card.

Placement is the scheduler's (daemon/scheduler.py: _record_pair): extract takes its GPUs (a
vLLM rank tensor_parallel_size of them, an hf rank one); train takes GPUs of its own when enough
are left, else it shares extract's, its rank i on extract's i-th GPU, and with fewer of
extract's GPUs than train ranks it never starts. On a shared card the extractor holds its share
(vLLM: gpu_memory_utilization × the card, which it takes whole at start-up; hf: what the target
needs, memoryestimate.estimate) and a training rank holds draft_need(). Arithmetic on config.json and
the run's settings, as the memory check's; not measured on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eyas.state import specs
from eyas.state.runconfig import RunConfig, stage_world_size
from eyas.state.target import text_value
from eyas.workers.doctor import memory, memoryestimate
from eyas.workers.doctor.check import Check, failed, human_bytes, passed

GROUP = memory.GROUP
NAME = "streaming"
# A training rank (workers/train/model.py, loop.py) keeps every parameter in float32 on its GPU,
# the frozen embedding and verifier head included (autocast computes in bf16), and for each
# trainable one a float32 gradient and AdamW's two float32 moments. DDP (train ranks > 1) keeps
# its gradient buckets beside the gradients (gradient_as_bucket_view is off): 4 bytes more.
PARAM_BYTES = 4
GRAD_BYTES = 4
ADAM_BYTES = 8
DDP_BUCKET_BYTES = 4
# Activations kept for the backward pass, per token of a step (train.batch_tokens), for each of
# draft.ttt_steps unrolled steps and each draft layer, in bf16: memoryestimate's ACT_HIDDEN_COPIES
# hidden-sized copies, the layer's 2 × hidden input (token embedding and hidden state side by
# side), its q, k and v, and the MLP's MLP_COPIES intermediate-sized tensors. Per step the
# logits over the draft vocabulary: bf16 from the head, then float32 log-probabilities and
# their gradient (2 + 4 + 4 bytes). Once per token: the draft's inputs (aux layers and the
# verifier's last state, bf16) and the verifier's target distribution (float32 logits and
# probabilities, 8 bytes). An estimate; the fixes it proposes keep a margin of its size.
ACT_BYTES = 2
STEP_LOGIT_BYTES = 10
TARGET_LOGIT_BYTES = 8


@dataclass(frozen=True)
class DraftShape:
    """The EAGLE-3 draft's sizes as speculators derives them from the verifier's config
    (speculators.train.cli.create_transformer_layer_config: a Llama decoder)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int  # the target's: the frozen embedding
    draft_vocab: int
    aux: int  # layer ids feeding the draft (all but the last)
    layers: int
    ttt_steps: int


def draft_shape(model: dict[str, Any] | None, cfg: RunConfig, n_ids: int) -> DraftShape | None:
    """From config.json (or its text_config) as transformers reads it: DeepSeek-V2/V3 configs
    set head_dim to qk_rope_head_dim; a dense FFN width is mirrored, a MoE's is 3 × hidden."""
    if not model:
        return None

    def get(key: str) -> int | None:
        value = text_value(model, key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    hidden, vocab = get("hidden_size"), get("vocab_size")
    if hidden is None or vocab is None:
        return None
    heads = get("num_attention_heads") or max(1, hidden // 128)
    kv = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or (get("qk_rope_head_dim") if get("kv_lora_rank") else None)
    # speculators' rule: a head_dim that does not tile the hidden size with the verifier's heads
    # sets the head count instead.
    if head_dim and hidden % heads and not hidden % head_dim:
        heads = hidden // head_dim
        kv = heads if heads % kv else kv
    return DraftShape(
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim or hidden // heads,
        intermediate=get("intermediate_size") or 3 * hidden,
        vocab=vocab,
        draft_vocab=cfg.draft.vocab_size,
        aux=max(1, n_ids - 1),
        layers=cfg.draft.num_layers,
        ttt_steps=cfg.draft.ttt_steps,
    )


def draft_parameters(d: DraftShape) -> tuple[int, int]:
    """(trainable, frozen) parameters of eyas's draft (workers/train/model.py), as
    tests/unit/workers/test_doctor_streaming.py counts them on real drafts: the first layer reads
    2 × hidden (embedding and state), later ones hidden; the fc fuses the aux layers, after a
    norm. Frozen (speculators loads them from the target and trains none): the target's
    embedding, the draft's head and the verifier's (the target's lm_head rows of the draft
    vocabulary, one copy each) and the verifier's final norm."""
    h, qkv = d.hidden, (d.heads + 2 * d.kv_heads) * d.head_dim
    mlp = 3 * h * d.intermediate
    first = 2 * h * qkv + d.heads * d.head_dim * h + mlp + 3 * h  # input, hidden and post-attention norms
    later = h * qkv + d.heads * d.head_dim * h + mlp + 2 * h
    trainable = first + (d.layers - 1) * later + d.aux * h * h + d.aux * h + h  # + the output norm
    frozen = d.vocab * h + 2 * h * d.draft_vocab + h
    return trainable, frozen


@dataclass(frozen=True)
class TrainNeed:
    """Bytes one training rank needs on its GPU, in parts."""

    trainable: int
    frozen: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    cuda_context: int
    batch_tokens: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.cuda_context


def draft_need(d: DraftShape, batch_tokens: int, train_ranks: int) -> TrainNeed:
    trainable, frozen = draft_parameters(d)
    h = d.hidden
    per_layer = memoryestimate.ACT_HIDDEN_COPIES * h + 2 * h + (d.heads + 2 * d.kv_heads) * d.head_dim
    per_layer += memoryestimate.MLP_COPIES * d.intermediate
    per_step = ACT_BYTES * d.layers * per_layer + STEP_LOGIT_BYTES * d.draft_vocab
    per_token = d.ttt_steps * per_step + ACT_BYTES * (d.aux + 1) * h + TARGET_LOGIT_BYTES * d.draft_vocab
    grads = trainable * (GRAD_BYTES + (DDP_BUCKET_BYTES if train_ranks > 1 else 0))
    return TrainNeed(
        trainable,
        frozen,
        (trainable + frozen) * PARAM_BYTES,
        grads,
        trainable * ADAM_BYTES,
        batch_tokens * per_token,
        memoryestimate.CUDA_CONTEXT,
        batch_tokens,
    )


def train_arithmetic(need: TrainNeed) -> str:
    """ "draft 1.19 B trainable + 1.40 B frozen parameters: weights ... = 42.19 GB"."""
    grads = "grads" if need.grads == need.trainable * GRAD_BYTES else "grads and DDP buckets"
    return (
        f"draft {need.trainable / 1e9:.2f} B trainable + {need.frozen / 1e9:.2f} B frozen parameters: "
        f"weights {human_bytes(need.weights)} (fp32) + {grads} {human_bytes(need.grads)} + "
        f"AdamW {human_bytes(need.optimizer)} + activations {human_bytes(need.activations)} "
        f"({need.batch_tokens} tokens a step) + CUDA context {human_bytes(need.cuda_context)} = "
        f"{human_bytes(need.total)}"
    )


def check(
    cfg: RunConfig,
    weight_bytes: int | None,
    usable: list[dict[str, Any]],
    model: dict[str, Any] | None,
    n_ids: int,
) -> Check | None:
    """The streaming placement's memory; None offline, on CPU, or without the sizes it needs."""
    if not specs.streaming(cfg.to_dict()) or not usable or weight_bytes is None:
        return None
    d = draft_shape(model, cfg, n_ids)
    if d is None:
        return None
    engine = memoryestimate.engine_of(cfg)
    vllm = engine.backend == "vllm"
    ex_world, tr_world = stage_world_size(cfg, "extract"), stage_world_size(cfg, "train")
    ex_gpus = ex_world * engine.tp
    need = draft_need(d, cfg.train.batch_tokens, tr_world)
    # The card the memory check judges: the freest extract may get, by its worst.
    gpu = min(sorted(usable, key=lambda g: g["mem_total"] - g["mem_used"], reverse=True)[:ex_gpus], key=_free)
    total, free = gpu["mem_total"], _free(gpu)
    target = memoryestimate.estimate(engine, memoryestimate.shape_of(model), weight_bytes, gpu)
    if vllm:
        util, util_from = _utilization(engine)
        share = int(util * total)
        share_text = f"vLLM's {util:.2f} × {human_bytes(total)} = {human_bytes(share)} ({util_from})"
    else:
        util, util_from = 0.0, ""
        share = target.total
        share_text = f"the hf extractor's {human_bytes(share)} (the memory check's arithmetic)"
    data = {
        "extract_gpus": ex_gpus,
        "train_ranks": tr_world,
        "usable": len(usable),
        "trainable": need.trainable,
        "frozen": need.frozen,
        "weights": need.weights,
        "grads": need.grads,
        "optimizer": need.optimizer,
        "activations": need.activations,
        "train_need": need.total,
        "extract_share": share,
        "gpu": gpu["index"],
        "total": total,
        "free": free,
    }
    per_rank = f"a training rank needs {train_arithmetic(need)}"
    if ex_gpus + tr_world <= len(usable):
        data["placement"] = "separate"
        detail = (
            f"train's {tr_world} rank(s) get GPUs of their own ({ex_gpus} for extract, {len(usable)} usable); "
            f"{per_rank}"
        )
        if need.total <= free:
            return passed(GROUP, NAME, f"{detail}, GPU {gpu['index']} has {human_bytes(free)} free", **data)
        return failed(
            GROUP,
            NAME,
            f"{detail}, over GPU {gpu['index']}'s {human_bytes(free)} free",
            _train_fix(d, need, tr_world, free),
            **data,
        )
    if ex_gpus < tr_world:
        data["placement"] = "none"
        return failed(
            GROUP,
            NAME,
            f"train's {tr_world} ranks can neither take GPUs of their own ({len(usable)} usable, extract takes "
            f"{ex_gpus}) nor share extract's {ex_gpus}: the run would wait for GPUs for ever",
            f"set [stages.train] ranks = {max(ex_gpus, len(usable) - ex_gpus)} or fewer",
            **data,
        )
    data["placement"] = "shared"
    used = share + need.total
    data["need"] = used
    detail = (
        f"train shares extract's GPUs ({ex_gpus} for extract, {len(usable)} usable, {tr_world} train rank(s)): "
        f"{share_text} + {per_rank} = {human_bytes(used)}"
    )
    if used <= free:
        return passed(GROUP, NAME, f"{detail}; GPU {gpu['index']} has {human_bytes(free)} free", **data)
    detail += f", over GPU {gpu['index']}'s {human_bytes(free)} free"
    fixes = []
    if vllm:
        # The most vLLM may take beside the training rank, if the target still fits in it.
        room = memoryestimate.floor2((free - need.total) / total)
        if room > 0 and target.total <= room * total:
            fixes.append(f"set [stages.extract] options = {{ vllm = {{ gpu_memory_utilization = {room:.2f} }} }}")
    fits = _smaller_step(d, cfg.train.batch_tokens, tr_world, free - share)
    if fits is not None:
        fixes.append(f"lower train.batch_tokens to {fits}")
    fixes.append(
        f"run where {ex_gpus + tr_world} GPUs are usable, so that train's {tr_world} rank(s) take GPUs of their own"
    )
    return failed(GROUP, NAME, detail, "; or ".join(fixes), **data)


def _free(gpu: dict[str, Any]) -> int:
    return gpu["mem_total"] - gpu["mem_used"]


def _utilization(engine: memoryestimate.Engine) -> tuple[float, str]:
    value = engine.options.get("gpu_memory_utilization")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value), f"[stages.{engine.stage}] options.vllm"
    return memoryestimate.vllm_default_utilization()


def _smaller_step(d: DraftShape, batch_tokens: int, ranks: int, room: int) -> int | None:
    """The largest power of two below batch_tokens, down to 1024, whose training rank fits `room`."""
    tokens = 1 << ((batch_tokens - 1).bit_length() - 1)
    while tokens >= 1024:
        if draft_need(d, tokens, ranks).total <= room:
            return tokens
        tokens //= 2
    return None


def _train_fix(d: DraftShape, need: TrainNeed, ranks: int, free: int) -> str:
    fits = _smaller_step(d, need.batch_tokens, ranks, free)
    return f"lower train.batch_tokens to {fits}" if fits is not None else "use GPUs with more memory"
