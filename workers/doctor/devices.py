"""The doctor's GPU check: the GPUs NVML sees, how many the run needs at once, and which of them it may use.

GPUs are counted through NVML (nvml.py: pynvml, or the JSON fake named by $EYAS_FAKE_NVML),
all of them, as the daemon's scheduler counts them; CUDA_VISIBLE_DEVICES is not read, since
the daemon sets it for the preflight rank itself. No GPU: CPU mode, memory against RAM
(memory.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from eyas.state.runconfig import RunConfig, stage_world_size
from eyas.state.specs import STAGES
from eyas.workers.doctor.check import Check, failed, passed

GROUP = "resources"  # the report's group of the GPU, memory, disk and streaming checks


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
