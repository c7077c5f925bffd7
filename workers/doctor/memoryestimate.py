"""What one GPU of the stage that loads the target needs, in parts: weights ÷ TP + activations of one forward + the KV cache of one batch + a CUDA context, as arithmetic on the target's config.json and the run's settings.

The stage is extract when the pipeline has it, else evaluate (`engine_of`); its engine's
defaults that the need scales with (gpu_memory_utilization, the batch sizes vLLM picks) are the
installed vLLM's, read from its source as text, never by importing it. The doctor's memory check
(memory.py), its streaming check (streaming.py) and `eyas init`'s sizing (cli/init.py) all judge
with this one estimate, so that what init picks, the doctor passes.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.state.inputtables import DataConfig
from eyas.state.runconfig import RunConfig, stage_settings
from eyas.state.target import text_value
from eyas.workers.doctor.check import human_bytes

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Without the model's shape (config.json lacks hidden_size or num_hidden_layers; callers that
# pass only a weight size) activations, KV cache and CUDA context are taken together as this
# floor (eyas init judges its TP with this same estimate, so what init picks passes).
KV_MARGIN_MIN = 2 * 2**30
# vLLM's CUDA context and the other memory it counts against its budget outside PyTorch's
# allocator: the context with PyTorch's and vLLM's kernels loaded (~0.5 GiB on Hopper), NCCL's
# and the custom all-reduce buffers at TP > 1 (~0.3 GiB), cuBLAS workspaces, and the 150 MiB
# that vLLM's profiler keeps back (gpu_worker.py, redundancy_buffer_memory). 1 GiB in all.
CUDA_CONTEXT = 2**30
# gpu_memory_utilization when the installed vLLM's source does not say (releases up to 0.11
# defaulted to 0.9); the installed default is read from vllm/config/cache.py without importing vLLM.
VLLM_UTILIZATION_FALLBACK = 0.9
# Activation bytes per token, as multiples of hidden_size × the dtype's bytes: the residual
# stream, a layer's normed input, its attention output and the tap's copy of the stream live at
# once. The MLP adds its gate/up output (2 × intermediate ÷ TP) and the activation's output
# (intermediate ÷ TP); a routed-expert (MoE) layer does so for each of its top-k experts and
# keeps their top-k outputs (hidden each, not split by TP) until they are summed.
ACT_HIDDEN_COPIES = 4
MLP_COPIES = 3
# vLLM's profile run samples max_num_seqs sequences: their logits, over the whole vocabulary,
# in float32, are the other peak it reserves for (the hf backend runs the decoder alone: none).
LOGIT_BYTES = 4


@dataclass(frozen=True)
class Shape:
    """The target's sizes that its activations and KV cache scale with (config.json, or its
    text_config for a wrapper such as Kimi-K2.5)."""

    hidden: int
    layers: int
    vocab: int
    intermediate: int  # the dense MLP's width
    moe_intermediate: int | None  # one routed expert's width; None: no routed experts
    experts_per_token: int
    kv_heads: int
    head_dim: int
    mla_width: int | None  # kv_lora_rank + qk_rope_head_dim: MLA caches one latent per token
    tied: bool  # tie_word_embeddings: one vocab × hidden matrix, not two
    quantized: str | None  # quantization_config.quant_method of a pre-quantized checkpoint


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def shape_of(model: dict[str, Any] | None) -> Shape | None:
    """The Shape of a config.json, or None without hidden_size and num_hidden_layers."""
    if not model:
        return None

    def get(key: str) -> int | None:
        return _positive(text_value(model, key))

    hidden, layers = get("hidden_size"), get("num_hidden_layers")
    if hidden is None or layers is None:
        return None
    heads = get("num_attention_heads") or max(1, hidden // 128)
    experts = get("n_routed_experts") or get("num_local_experts") or get("num_experts")
    topk = get("num_experts_per_tok") or get("moe_topk")
    moe = get("moe_intermediate_size") if experts and topk else None
    lora, rope = get("kv_lora_rank"), get("qk_rope_head_dim")
    quant = text_value(model, "quantization_config")
    return Shape(
        hidden=hidden,
        layers=layers,
        vocab=get("vocab_size") or 0,
        intermediate=get("intermediate_size") or 4 * hidden,  # the classic FFN width when unnamed
        moe_intermediate=moe,
        experts_per_token=topk or 0,
        kv_heads=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or hidden // heads,
        mla_width=lora + rope if lora and rope else None,
        tied=text_value(model, "tie_word_embeddings") is True,
        quantized=str(quant.get("quant_method") or "yes") if isinstance(quant, dict) else None,
    )


@dataclass(frozen=True)
class Engine:
    """How the stage that loads the target runs it: extract when the pipeline has it, else
    evaluate (always vLLM). Its memory need scales with these."""

    stage: str
    backend: str  # vllm | hf
    tp: int
    options: dict[str, Any]  # [stages.<stage>] options.vllm as written: vLLM engine arguments
    max_model_len: int
    seqs: int  # sequences in one batch (extract.batch_size; evaluate.batch_size)
    batch_tokens: int  # the hf backend's forward: seqs padded to data.max_length
    dtype_bytes: int
    tp_key: str  # the key that sets tp
    len_extra: int  # max_model_len - data.max_length


def engine_of(cfg: RunConfig) -> Engine:
    """The Engine of the stage whose memory the check judges."""
    # Rows are cut to data.max_length by prepare, so no sample is longer.
    max_length = cfg.data.max_length if cfg.data is not None else DataConfig.model_fields["max_length"].default
    dtype = DTYPE_BYTES[cfg.target.dtype] if cfg.target is not None else 2
    stage = "extract" if "extract" in cfg.pipeline or "evaluate" not in cfg.pipeline else "evaluate"
    options = stage_settings(cfg, stage)[2].get("vllm") or {}
    if stage == "extract":
        vllm = cfg.extract.backend == "vllm"
        return Engine(
            stage,
            cfg.extract.backend,
            cfg.extract.tensor_parallel_size if vllm else 1,
            options,
            # workers/vllm/engine.py: the longest sample + 1, unless the options set it.
            _positive(options.get("max_model_len")) or max_length + 1,
            cfg.extract.batch_size,
            cfg.extract.batch_size * max_length,
            dtype,
            "extract.tensor_parallel_size",
            1,
        )
    ev = cfg.evaluate
    # workers/evaluate/engines.py: the longest prompt, its answer and one round of drafts.
    length = max_length + ev.max_tokens + ev.num_speculative_tokens + 8
    return Engine(
        stage,
        "vllm",
        ev.tensor_parallel_size or cfg.extract.tensor_parallel_size,
        options,
        _positive(options.get("max_model_len")) or length,
        ev.batch_size,
        ev.batch_size * length,
        dtype,
        "evaluate.tensor_parallel_size",
        length - max_length,
    )


@functools.lru_cache(maxsize=4)
def vllm_default_utilization(root: str | None = None) -> tuple[float, str]:
    """(gpu_memory_utilization vLLM uses when a run sets none, where that figure comes from),
    read from the installed vLLM's vllm/config/cache.py as text: importing vLLM takes seconds
    and may fail, which the versions check reports. `root`: a vllm package folder (the tests')."""
    if root is None:
        spec = importlib.util.find_spec("vllm")  # finds the package without running it
        root = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else None
    try:
        text = (Path(root) / "config" / "cache.py").read_text(encoding="utf-8") if root else ""
    except OSError:
        text = ""
    found = UTILIZATION_DEFAULT.search(text)
    if found is None:
        return VLLM_UTILIZATION_FALLBACK, "vLLM's usual default"
    return float(found.group(1)), "the installed vLLM's default"


# `gpu_memory_utilization: float = Field(default=0.92, ...)` (0.32), `... float = 0.9` (older).
UTILIZATION_DEFAULT = re.compile(r"gpu_memory_utilization:\s*float\s*=\s*(?:Field\(\s*default\s*=\s*)?([0-9.]+)")


def vllm_batch_defaults(total: int, name: str) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that `vllm.LLM` picks on a GPU of `total` bytes
    named `name` when the run sets neither (vLLM 0.32's EngineArgs.get_batch_defaults)."""
    if total >= 70 * 2**30 and "a100" not in name.lower():
        return 16384, 1024
    return 8192, 256


def fp8_bytes(weight_bytes: int, shape: Shape | None) -> int:
    """A 16-bit checkpoint's size once vLLM quantizes it online (quantization = "fp8"): the
    linear layers and experts halve; the embedding and the LM head stay 16-bit."""
    kept = 0 if shape is None else min(weight_bytes, shape.vocab * shape.hidden * 2 * (1 if shape.tied else 2))
    return kept + (weight_bytes - kept) // 2


@dataclass(frozen=True)
class Need:
    """Bytes one GPU needs, in parts, and the figures they were sized from."""

    weights: int  # the checkpoint's bytes
    per_gpu_weights: int
    activations: int
    kv_cache: int
    cuda_context: int
    margin: int  # only without the model's shape: activations, KV and context together
    step_tokens: int  # tokens in one forward
    max_num_seqs: int
    kv_tokens: int
    max_model_len: int
    tp: int
    fp8: bool  # weights counted as vLLM's online fp8

    @property
    def total(self) -> int:
        return self.per_gpu_weights + self.activations + self.kv_cache + self.cuda_context + self.margin


def estimate(
    engine: Engine,
    shape: Shape | None,
    weight_bytes: int,
    gpu: dict[str, Any],
    *,
    tp: int | None = None,
    max_model_len: int | None = None,
    fp8: bool | None = None,
) -> Need:
    """What one GPU of the stage's engine needs; tp, max_model_len and fp8 override the run's
    (the fixes are judged with them)."""
    tp = tp or engine.tp
    opts = engine.options
    max_model_len = max_model_len or engine.max_model_len
    vllm = engine.backend == "vllm"
    if fp8 is None:
        fp8 = opts.get("quantization") == "fp8"
    fp8 = fp8 and vllm and engine.dtype_bytes == 2 and not (shape and shape.quantized)
    on_gpu = fp8_bytes(weight_bytes, shape) if fp8 else weight_bytes
    per_gpu = -(-on_gpu // tp)
    default_tokens, default_seqs = vllm_batch_defaults(gpu["mem_total"], gpu.get("name") or "")
    if vllm:
        steps = _positive(opts.get("max_num_batched_tokens")) or default_tokens
        if opts.get("enable_chunked_prefill") is False:
            steps = max(steps, max_model_len)  # vLLM then schedules whole prompts
        seqs = _positive(opts.get("max_num_seqs")) or (engine.seqs if engine.stage == "evaluate" else default_seqs)
    else:
        steps, seqs = engine.batch_tokens, engine.seqs
    kv_tokens = min(engine.seqs, seqs) * max_model_len if vllm else 0
    figures = dict(step_tokens=steps, max_num_seqs=seqs, kv_tokens=kv_tokens, max_model_len=max_model_len)
    if shape is None:
        return Need(weight_bytes, per_gpu, 0, 0, 0, KV_MARGIN_MIN, tp=tp, fp8=fp8, **figures)
    b = engine.dtype_bytes
    dense = MLP_COPIES * -(-shape.intermediate // tp)
    routed = 0
    if shape.moe_intermediate:
        routed = shape.experts_per_token * (MLP_COPIES * -(-shape.moe_intermediate // tp) + shape.hidden)
    per_token = b * (ACT_HIDDEN_COPIES * shape.hidden + max(dense, routed))
    logits = seqs * shape.vocab * LOGIT_BYTES if vllm else 0
    kv_b = 1 if str(opts.get("kv_cache_dtype", "")).startswith("fp8") else b
    if shape.mla_width:  # the latent is not split by TP: every rank caches all of it
        kv_per_token = shape.layers * shape.mla_width * kv_b
    else:
        kv_per_token = shape.layers * 2 * -(-shape.kv_heads // tp) * shape.head_dim * kv_b
    return Need(
        weight_bytes,
        per_gpu,
        steps * per_token + logits,
        kv_tokens * kv_per_token,
        CUDA_CONTEXT,
        0,
        tp=tp,
        fp8=fp8,
        **figures,
    )


def arithmetic(need: Need, engine: Engine) -> str:
    """ "weights 74.38 GB/GPU (595.00 GB ÷ TP 8) + activations ... = 80.29 GB"."""
    source = f"{human_bytes(need.weights)}{' as fp8' if need.fp8 else ''}"
    split = f"({source} ÷ TP {need.tp})" if need.tp > 1 else f"({source})" if need.fp8 else ""
    parts = [f"weights {human_bytes(need.per_gpu_weights)}/GPU{' ' + split if split else ''}"]
    if need.margin:
        parts.append(f"{human_bytes(need.margin)} margin (the model's shape is unknown)")
    else:
        batch = (
            f"{need.step_tokens} tokens a step" if engine.backend == "vllm" else f"{need.step_tokens} tokens a batch"
        )
        parts.append(f"activations {human_bytes(need.activations)} ({batch})")
        if engine.backend == "vllm":
            kv_seqs = need.kv_tokens // need.max_model_len
            parts.append(f"KV cache {human_bytes(need.kv_cache)} ({kv_seqs} × {need.max_model_len} tokens)")
        parts.append(f"CUDA context {human_bytes(need.cuda_context)}")
    return " + ".join(parts) + f" = {human_bytes(need.total)}"


def floor2(x: float) -> float:
    """x rounded down to hundredths: a gpu_memory_utilization that stays within x."""
    return math.floor(x * 100 + 1e-9) / 100


def ceil2(x: float) -> float:
    """x rounded up to hundredths: a gpu_memory_utilization that covers x."""
    return math.ceil(x * 100 - 1e-9) / 100
