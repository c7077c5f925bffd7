"""The doctor's resource checks: GPUs for the ranks and tensor parallelism, memory for the
target's weights, disk for the hidden states, and a writable output folder.

GPUs are counted through NVML (nvml.py: pynvml, or the JSON fake named by $EYAS_FAKE_NVML),
all of them, as the daemon's scheduler counts them; CUDA_VISIBLE_DEVICES is not read, since
the daemon sets it for the preflight rank itself. No GPU: CPU mode, memory against RAM.

Memory on GPUs is arithmetic on the target's config.json and the run's settings (estimate):
weights ÷ TP + activations of one forward + the KV cache of one batch + a CUDA context, per
GPU, against what the stage's engine may use there: on vLLM gpu_memory_utilization × the
card (the run's engine option, else the installed vLLM's default, read from its source), on
the hf backend the free memory. A failure names each change that the same arithmetic says fits.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.state.inputtables import DataConfig
from eyas.state.runconfig import RunConfig, stage_settings, stage_world_size
from eyas.state.specs import STAGES
from eyas.state.target import text_value
from eyas.workers.doctor.check import Check, failed, human_bytes, passed, warned

GROUP = "resources"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Without the model's shape (config.json lacks hidden_size or num_hidden_layers; callers that
# pass only a weight size) activations, KV cache and CUDA context are taken together as this
# floor (eyas init judges its TP with this same estimate, so what init picks passes).
KV_MARGIN_MIN = 2 * 2**30
# CPU mode: a tenth of the weights for activations, plus the KV cache vLLM's CPU build reserves
# when VLLM_CPU_KVCACHE_SPACE (GiB) is set. No CUDA context there.
CPU_MARGIN_FRACTION = 0.10
# vLLM's CUDA context and the other memory it counts against its budget outside PyTorch's
# allocator: the context with PyTorch's and vLLM's kernels loaded (~0.5 GiB on Hopper), NCCL's
# and the custom all-reduce buffers at TP > 1 (~0.3 GiB), cuBLAS workspaces, and the 150 MiB
# that vLLM's profiler keeps back (gpu_worker.py, redundancy_buffer_memory). 1 GiB in all.
CUDA_CONTEXT = 2**30
# gpu_memory_utilization when the installed vLLM's source does not say (releases up to 0.11
# defaulted to 0.9); the installed default is read from vllm/config/cache.py without importing vLLM.
VLLM_UTILIZATION_FALLBACK = 0.9
# The most the doctor proposes for gpu_memory_utilization: the rest of the card is the room
# this estimate's errors (fragmentation, kernels' workspaces) need.
UTILIZATION_MAX = 0.95
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
# Without prepare's count, tokens are estimated from the data's bytes: ~4 bytes of JSON text
# per token errs high (JSON keys and escapes count as text), so the disk need does too.
BYTES_PER_TOKEN = 4
SAMPLE_BYTES = 32 * 2**20


@dataclass(frozen=True)
class Gpus:
    available: bool
    devices: list[dict[str, Any]]  # nvml.GpuProbe.devices() rows: index, name, mem_used, mem_total
    why: str = ""  # why none (no driver, no pynvml)


def probe_gpus() -> Gpus:
    from eyas.workers.nvml import GpuProbe

    messages: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    log = logging.getLogger("eyas.doctor.nvml")
    log.propagate = False
    log.setLevel(logging.INFO)  # GpuProbe says why there is no NVML at INFO
    log.handlers[:] = [_Keep()]
    probe = GpuProbe(log=log)
    try:
        if not probe.start():
            return Gpus(False, [], messages[-1] if messages else "NVML unavailable")
        return Gpus(True, probe.devices())
    finally:
        probe.shutdown()


def _uses_target(cfg: RunConfig) -> bool:
    return any(s in cfg.pipeline for s in ("extract", "evaluate"))


def gpu_need(cfg: RunConfig) -> tuple[int, str]:
    """(GPUs the run needs at once, which stage needs them): the daemon gives each rank one
    GPU, and a vLLM extract rank tensor_parallel_size of them."""
    best, why = 0, ""
    for stage in cfg.pipeline:
        world = stage_world_size(cfg, stage)
        tp = cfg.extract.tensor_parallel_size if stage == "extract" and cfg.extract.backend == "vllm" else 1
        if not STAGES[stage].distributed and tp == 1:
            continue
        if world * tp > best:
            best = world * tp
            why = (
                (f"extract.tensor_parallel_size {tp}" + (f" × {world} ranks" if world > 1 else ""))
                if tp > 1
                else f"{stage} with {world} rank{'s' if world != 1 else ''}"
            )
    return best, why


def gpus(cfg: RunConfig, found: Gpus) -> tuple[Check, list[dict[str, Any]]]:
    """The GPU check, and the devices the run may use ([] in CPU mode)."""
    wanted = cfg.resources.devices
    need, why = gpu_need(cfg)
    if wanted == "cpu":
        return passed(GROUP, "gpus", 'CPU mode (resources.devices = "cpu")', mode="cpu", need=need), []
    if not found.available or not found.devices:
        reason = found.why or "NVML reports no device"
        if isinstance(wanted, tuple):
            return failed(
                GROUP,
                "gpus",
                f"resources.devices lists GPUs {', '.join(map(str, wanted))}, but no GPU is visible ({reason})",
                'set resources.devices = "cpu", or run on the GPU host',
                mode="none",
                need=need,
            ), []
        return passed(GROUP, "gpus", f"no GPU visible ({reason}): CPU mode", mode="cpu", need=need), []
    by_index = {d["index"]: d for d in found.devices}
    listing = ", ".join(f"{d['index']}: {d['name']}" for d in found.devices)
    if isinstance(wanted, tuple):
        absent = [i for i in wanted if i not in by_index]
        if absent:
            return failed(
                GROUP,
                "gpus",
                f"resources.devices lists GPU {absent[0]}, which is not visible "
                f"({len(found.devices)} visible: {listing})",
                f"list only visible GPUs in resources.devices (0 to {len(found.devices) - 1})",
                mode="gpu",
                need=need,
            ), []
        usable = [by_index[i] for i in wanted]
    else:
        usable = list(found.devices)
    data = {"mode": "gpu", "need": need, "visible": len(found.devices), "usable": len(usable)}
    if need > len(usable):
        tp = cfg.extract.tensor_parallel_size
        if why.startswith("extract.tensor_parallel_size") and tp > len(usable):
            fix = f"lower extract.tensor_parallel_size to {len(usable)} or less, or run where {need} GPUs are visible"
        else:
            fix = f"lower resources.ranks to {len(usable)} or less, or run where {need} GPUs are visible"
        return failed(GROUP, "gpus", f"{why} needs {need} GPUs, {len(usable)} usable ({listing})", fix, **data), usable
    return passed(
        GROUP,
        "gpus",
        f"{len(usable)} usable ({listing}); the run needs {need or 1} at once ({why or 'one rank'})",
        **data,
    ), usable


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
            # workers/vllm/backend.py: the longest sample + 1, unless the options set it.
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


def _floor2(x: float) -> float:
    return math.floor(x * 100 + 1e-9) / 100


def _ceil2(x: float) -> float:
    return math.ceil(x * 100 - 1e-9) / 100


def memory(
    cfg: RunConfig,
    weight_bytes: int | None,
    usable: list[dict[str, Any]],
    ram_available: int | None = None,
    model: dict[str, Any] | None = None,
) -> Check | None:
    """The target's weights and what running them takes, per GPU, against what the stage's
    engine may use there; in CPU mode, the whole model against available RAM. None when no stage
    loads the target. `model`: the target's config.json, which sizes activations and KV cache.

    On vLLM a GPU's capacity is gpu_memory_utilization × its memory (the run's engine option, else
    the installed vLLM's default), and vLLM refuses to start where less than that is free; on
    the hf backend it is the free memory."""
    if not _uses_target(cfg):
        return None
    if weight_bytes is None:
        return warned(
            GROUP,
            "memory",
            "the weights' size is unknown (no safetensors index)",
            "point target.path at a safetensors checkpoint so its memory need can be checked",
        )
    engine = engine_of(cfg)
    if not usable:
        return _cpu_memory(cfg, weight_bytes, ram_available)
    shape = shape_of(model)
    vllm = engine.backend == "vllm"
    if vllm:
        if _positive_float(engine.options.get("gpu_memory_utilization")) is not None:
            util, util_from = float(engine.options["gpu_memory_utilization"]), f"[stages.{engine.stage}] options.vllm"
        else:
            util, util_from = vllm_default_utilization()
    else:
        util, util_from = 1.0, ""

    def capacity(d: dict[str, Any]) -> int:
        free = d["mem_total"] - d["mem_used"]
        return min(int(util * d["mem_total"]), free) if vllm else free

    # The daemon may place the ranks on any usable GPU: judge the `tp` freest, by their worst.
    chosen = sorted(usable, key=capacity, reverse=True)[: engine.tp]
    gpu = min(chosen, key=capacity)
    total, free = gpu["mem_total"], gpu["mem_total"] - gpu["mem_used"]
    need = estimate(engine, shape, weight_bytes, gpu)
    budget = int(util * total)
    data = {
        "mode": "gpu",
        "backend": engine.backend,
        "stage": engine.stage,
        "tp": need.tp,
        "need": need.total,
        "per_gpu_weights": need.per_gpu_weights,
        "activations": need.activations,
        "kv_cache": need.kv_cache,
        "cuda_context": need.cuda_context,
        "margin": need.margin,
        "step_tokens": need.step_tokens,
        "kv_tokens": need.kv_tokens,
        "max_model_len": need.max_model_len,
        "fp8": need.fp8,
        "gpu": gpu["index"],
        "total": total,
        "free": free,
    }
    arithmetic_text = arithmetic(need, engine)
    if not vllm:
        detail = f"{arithmetic_text}; GPU {gpu['index']} has {human_bytes(free)} free"
        if need.total <= free:
            return passed(GROUP, "memory", detail, **data)
        return failed(
            GROUP,
            "memory",
            detail,
            'use extract.backend = "vllm" with tensor_parallel_size to shard the weights, or free GPU memory',
            **data,
        )
    data.update(gpu_memory_utilization=util, utilization_from=util_from, capacity=budget)
    may_use = (
        f"vLLM may use {util:.2f} × {human_bytes(total)} = {human_bytes(budget)} of GPU {gpu['index']} ({util_from})"
    )
    if need.total <= budget <= free:
        return passed(GROUP, "memory", f"{arithmetic_text}; {may_use}, {human_bytes(free)} free", **data)
    if need.total > budget:
        detail = f"{arithmetic_text}, over what {may_use}"
    else:
        detail = (
            f"{arithmetic_text}; {may_use}, but only {human_bytes(free)} is free there "
            f"(other processes hold {human_bytes(gpu['mem_used'])}): vLLM refuses to start"
        )
    return failed(
        GROUP, "memory", detail, _memory_fix(engine, shape, weight_bytes, gpu, need, util, len(usable)), **data
    )


def _positive_float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def _memory_fix(
    engine: Engine, shape: Shape | None, weight_bytes: int, gpu: dict[str, Any], need: Need, util: float, usable: int
) -> str:
    """The options that would make the stage fit, each judged with the same arithmetic: a
    gpu_memory_utilization that fits, a shorter max_model_len, fp8 weights, more GPUs."""
    total, free = gpu["mem_total"], gpu["mem_total"] - gpu["mem_used"]
    option = f"[stages.{engine.stage}] options = {{ vllm = {{ gpu_memory_utilization = %.2f }} }}"
    fixes = []
    # The most vLLM can be given where other processes hold memory: it starts only when its
    # whole budget is free.
    start = min(util, _floor2(free / total))
    if start < util:
        fixes.append(f"free the {human_bytes(gpu['mem_used'])} other processes hold on GPU {gpu['index']}")
        if need.total <= start * total:
            fixes.append("set " + option % start)
    elif need.total > util * total:
        wanted = _ceil2(need.total / total)
        if wanted <= UTILIZATION_MAX and wanted * total <= free:
            fixes.append("set " + option % wanted)
    room = start * total
    suffix = f" and gpu_memory_utilization = {start:.2f}" if start < util else ""
    current = engine.max_model_len - engine.len_extra  # data.max_length, or as the options set it
    if shape is not None and current > 256:
        length = 1 << ((current - 1).bit_length() - 1)  # the power of two below it
        while length >= 256:
            if estimate(engine, shape, weight_bytes, gpu, max_model_len=length + engine.len_extra).total <= room:
                if "max_model_len" in engine.options:
                    fixes.append(f"lower max_model_len in the vllm options to {length}{suffix}")
                else:
                    fixes.append(f"lower data.max_length to {length} (max_model_len follows it){suffix}")
                break
            length //= 2
    if engine.dtype_bytes == 2 and not need.fp8 and not (shape and shape.quantized):
        fp8 = estimate(engine, shape, weight_bytes, gpu, fp8=True)
        if fp8.total <= room:
            fixes.append(
                f'quantize to fp8 ([stages.{engine.stage}] options = {{ vllm = {{ quantization = "fp8" }} }}: '
                f"{human_bytes(fp8.total)} per GPU){suffix}"
            )
    for tp in (2, 4, 8, 16, 32, 64):
        if tp > need.tp and estimate(engine, shape, weight_bytes, gpu, tp=tp).total <= room:
            more = f"raise {engine.tp_key} to {tp}" if tp <= usable else f"run on {tp} GPUs with {engine.tp_key} = {tp}"
            fixes.append(f"{more}{suffix}")
            break
    if not fixes:
        return "use GPUs with more memory"
    return "; or ".join(fixes)


def _cpu_memory(cfg: RunConfig, weight_bytes: int, ram_available: int | None) -> Check:
    """CPU mode: the whole model and a tenth more against available RAM."""
    if ram_available is None:
        import psutil

        ram_available = psutil.virtual_memory().available
    margin = int(CPU_MARGIN_FRACTION * weight_bytes)
    if cfg.extract.backend == "vllm" and os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").isdigit():
        margin += int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
    need = weight_bytes + margin
    data = {"mode": "cpu", "need": need, "weights": weight_bytes, "margin": margin, "free": ram_available}
    detail = (
        f"CPU mode: needs {human_bytes(need)} of RAM (weights {human_bytes(weight_bytes)} + "
        f"{human_bytes(margin)} margin), {human_bytes(ram_available)} available"
    )
    if need > ram_available:
        return failed(GROUP, "memory", detail, "free RAM, or run on a GPU host", **data)
    return passed(GROUP, "memory", detail, **data)


def estimate_tokens(cfg: RunConfig, output_dir: str) -> tuple[int | None, str]:
    """(tokens to extract, where the figure comes from): prepare's summary if it ran, else an
    estimate from the dataset's size."""
    summary = Path(output_dir) / "prepare" / "summary.json"
    try:
        tokens = json.loads(summary.read_text())["tokens"]
        if isinstance(tokens, int):
            return tokens, f"prepare's summary ({summary})"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if cfg.data is None:
        return None, "no [data] and no prepare summary"
    from eyas.workers.data.reader import DataError, count_rows, data_files, row_byte_limit

    try:
        files = data_files(cfg.data.path)
    except DataError as exc:
        return None, str(exc)
    size = sum(f.stat().st_size for f in files)
    if size <= 8 * SAMPLE_BYTES:
        try:
            rows = count_rows(files, row_byte_limit(cfg.data.max_length))
        except DataError as exc:  # an array prepare refuses: the data check names it
            return None, str(exc).partition("; ")[0]
    else:
        # A large dataset: rows from the line density of its first bytes (reading all of it
        # would make the doctor as slow as prepare).
        sample = b""
        for f in files:
            with open(f, "rb") as fh:
                sample += fh.read(SAMPLE_BYTES - len(sample))
            if len(sample) >= SAMPLE_BYTES:
                break
        lines = sum(1 for line in sample.split(b"\n") if line.strip()) or 1
        rows = int(size * lines / len(sample))
    if cfg.data.limit:
        rows = min(rows, cfg.data.limit)
    if rows == 0:
        return 0, f"{cfg.data.path} holds no rows"
    mean = min(cfg.data.max_length, max(1, size // max(rows, 1) // BYTES_PER_TOKEN))
    return (
        rows * mean,
        f"estimate: {rows} rows × ~{mean} tokens (data size ÷ {BYTES_PER_TOKEN} B/token, "
        f"capped at max_length {cfg.data.max_length})",
    )


def existing_parent(path: str) -> Path:
    """The nearest existing folder at or above `path` (where the run's files will be created)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def disk(cfg: RunConfig, output_dir: str, num_ids: int, hidden: int | None, free: int | None = None) -> Check | None:
    """Bytes of the hidden states (tokens × ids × hidden × dtype, plus the int64 token ids)
    against the free space where they will be written. None without an extract stage."""
    if "extract" not in cfg.pipeline:
        return None
    tokens, source = estimate_tokens(cfg, output_dir)
    if tokens is None or hidden is None:
        why = source if tokens is None else "no hidden_size"
        return warned(
            GROUP,
            "disk",
            f"cannot estimate the hidden states' size ({why})",
            "make sure the output folder has room for tokens × layer ids × hidden_size × dtype bytes",
        )
    width = DTYPE_BYTES[cfg.target.dtype]
    need = tokens * (num_ids * hidden * width + 8)
    where = existing_parent(os.path.join(output_dir, "extract"))
    if free is None:
        free = shutil.disk_usage(where).free
    detail = (
        f"hidden states need {human_bytes(need)} ({tokens} tokens × {num_ids} ids × {hidden} × {width} B; "
        f"{source}); {human_bytes(free)} free at {where}"
    )
    data = {"need": need, "tokens": tokens, "free": free, "path": str(where)}
    if need > free:
        return failed(
            GROUP, "disk", detail, "point output_dir at a bigger disk, lower data.limit, or use fewer layer ids", **data
        )
    return passed(GROUP, "disk", detail, **data)


def writable(output_dir: str) -> Check:
    """The run's output folder can be created and written (a temp file, removed at once)."""
    target = Path(os.path.abspath(output_dir))
    if target.exists() and not target.is_dir():
        return failed(GROUP, "output dir", f"{target} is a file", "point output_dir at a folder")
    where = existing_parent(str(target))
    if not where.is_dir():
        return failed(
            GROUP,
            "output dir",
            f"{target} cannot be created: {where} is a file",
            "point output_dir at a folder under a writable directory",
        )
    try:
        with tempfile.NamedTemporaryFile(dir=where, prefix=".eyas-doctor-"):
            pass
    except OSError as exc:
        return failed(
            GROUP,
            "output dir",
            f"{where} is not writable ({exc.strerror or exc})",
            "point output_dir at a writable folder, or fix its permissions",
        )
    state = "exists" if target.exists() else f"will be created under {where}"
    return passed(GROUP, "output dir", f"{target} {state}, writable", path=str(target))
