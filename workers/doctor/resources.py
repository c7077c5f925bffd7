"""The doctor's resource checks: GPUs for the ranks and tensor parallelism, memory for the
target's weights, disk for the hidden states, and a writable output folder.

GPUs are counted through NVML (nvml.py: pynvml, or the JSON fake named by $EYAS_FAKE_NVML),
all of them, as the daemon's scheduler counts them; CUDA_VISIBLE_DEVICES is not read, since
the daemon sets it for the preflight rank itself. No GPU: CPU mode, memory against RAM.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.state.runconfig import RunConfig, stage_world_size
from eyas.state.specs import STAGES
from eyas.workers.doctor.check import Check, failed, human_bytes, passed, warned

GROUP = "resources"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Room for the KV cache and activations beside the weights, per GPU. Extraction runs prefill
# only (max_tokens=1) on batches of at most max_length tokens, so a tenth of the weights, and
# no less than 2 GiB (CUDA context, allocator slack), is ample; vLLM sizes its KV cache into
# whatever is left. In CPU mode there is no CUDA context: a tenth of the weights, plus the KV
# cache vLLM's CPU build reserves when VLLM_CPU_KVCACHE_SPACE (GiB) is set.
KV_MARGIN_FRACTION = 0.10
KV_MARGIN_MIN = 2 * 2**30
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


def memory(
    cfg: RunConfig, weight_bytes: int | None, usable: list[dict[str, Any]], ram_available: int | None = None
) -> Check | None:
    """Weights per GPU (÷ TP on vLLM) plus the KV margin, against the freest usable GPUs;
    in CPU mode, the whole model against available RAM. None when no stage loads the target."""
    if not _uses_target(cfg):
        return None
    if weight_bytes is None:
        return warned(
            GROUP,
            "memory",
            "the weights' size is unknown (no safetensors index)",
            "point target.path at a safetensors checkpoint so its memory need can be checked",
        )
    tp = cfg.extract.tensor_parallel_size if cfg.extract.backend == "vllm" else 1
    if not usable:
        if ram_available is None:
            import psutil

            ram_available = psutil.virtual_memory().available
        margin = int(KV_MARGIN_FRACTION * weight_bytes)
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
    per_gpu = -(-weight_bytes // tp)
    margin = max(KV_MARGIN_MIN, int(KV_MARGIN_FRACTION * per_gpu))
    need = per_gpu + margin
    # The daemon may place the ranks on any usable GPU: judge the `tp` freest ones.
    chosen = sorted(usable, key=lambda d: d["mem_total"] - d["mem_used"], reverse=True)[:tp]
    worst = min(chosen, key=lambda d: d["mem_total"] - d["mem_used"])
    free = worst["mem_total"] - worst["mem_used"]
    split = f"weights {human_bytes(weight_bytes)} ÷ TP {tp}" if tp > 1 else f"weights {human_bytes(weight_bytes)}"
    detail = (
        f"needs {human_bytes(need)} per GPU ({split} + {human_bytes(margin)} KV margin); "
        f"GPU {worst['index']} has {human_bytes(free)} free"
    )
    data = {
        "mode": "gpu",
        "need": need,
        "per_gpu_weights": per_gpu,
        "margin": margin,
        "free": free,
        "gpu": worst["index"],
        "tp": tp,
    }
    if need <= free:
        return passed(GROUP, "memory", detail, **data)
    fits = [
        t
        for t in (2, 4, 8, 16, 32, 64)
        if t <= len(usable)
        and -(-weight_bytes // t) + max(KV_MARGIN_MIN, int(KV_MARGIN_FRACTION * -(-weight_bytes // t))) <= free
    ]
    if cfg.extract.backend == "vllm" and fits and fits[0] > tp:
        fix = f"raise extract.tensor_parallel_size to {fits[0]}, or free memory on the GPUs"
    elif cfg.extract.backend == "hf":
        fix = 'use extract.backend = "vllm" with tensor_parallel_size to shard the weights, or free GPU memory'
    else:
        fix = "free memory on the GPUs (other processes hold it), or use GPUs with more memory"
    return failed(GROUP, "memory", detail, fix, **data)


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
