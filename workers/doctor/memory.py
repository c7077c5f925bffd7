"""The doctor's memory check: what one GPU of the stage that loads the target needs (memoryestimate.py) against what that stage's engine may use there, or the whole model against RAM in CPU mode; a failure names each change that the same arithmetic says fits.

What the engine may use: on vLLM gpu_memory_utilization × the card (the run's engine option, else
the installed vLLM's default, read from its source), on the hf backend the free memory.
"""

from __future__ import annotations

import os
from typing import Any

from eyas.state.runconfig import RunConfig
from eyas.workers.doctor.check import Check, failed, human_bytes, passed, warned
from eyas.workers.doctor.memoryestimate import (
    Engine,
    Need,
    Shape,
    arithmetic,
    ceil2,
    engine_of,
    estimate,
    floor2,
    shape_of,
    vllm_default_utilization,
)

GROUP = "resources"  # the report's group of the GPU, memory, disk and streaming checks

# CPU mode: a tenth of the weights for activations, plus the KV cache vLLM's CPU build reserves
# when VLLM_CPU_KVCACHE_SPACE (GiB) is set. No CUDA context there.
CPU_MARGIN_FRACTION = 0.10
# The most the doctor proposes for gpu_memory_utilization: the rest of the card is the room
# this estimate's errors (fragmentation, kernels' workspaces) need.
UTILIZATION_MAX = 0.95


def _uses_target(cfg: RunConfig) -> bool:
    return any(s in cfg.pipeline for s in ("extract", "evaluate"))


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
    start = min(util, floor2(free / total))
    if start < util:
        fixes.append(f"free the {human_bytes(gpu['mem_used'])} other processes hold on GPU {gpu['index']}")
        if need.total <= start * total:
            fixes.append("set " + option % start)
    elif need.total > util * total:
        wanted = ceil2(need.total / total)
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
