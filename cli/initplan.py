"""The arithmetic of `eyas init`: where the extraction runs (backend, tensor-parallel size, ranks) and how long training warms up, as pure functions of the target's numbers and the GPUs'.

No file, no NVML, no engine: cli/init.py reads the target and counts the GPUs, this module
decides, and its tests feed it numbers. Every decision carries the sentence that justifies it,
which init writes beside the key.

The fit rule: a shard of ceil(weights ÷ TP) bytes plus MARGIN must fit in vLLM's budget,
gpu_memory_utilization (0.9, vLLM's default, which eyas leaves as it is) × the GPU's memory.
The 10 % vLLM leaves outside its budget holds the CUDA context; MARGIN, inside it, holds the
activations of a prefill batch and a minimal KV cache. A TP chosen so also passes `eyas doctor`'s
memory check on idle GPUs (weights ÷ TP + max(MARGIN, 10 % of that) ≤ free memory), since
w + MARGIN ≤ 0.9·M implies both w + MARGIN ≤ M and 1.1·w ≤ 0.99·M.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eyas.workers.doctor.check import human_bytes
from eyas.workers.doctor.resources import KV_MARGIN_MIN

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization
MARGIN = KV_MARGIN_MIN  # the doctor's floor for the KV cache and activations, per GPU
DRAFT_VOCAB = 32000  # EAGLE-3's usual draft vocabulary (speculators' default)
WARMUP_FRACTION = 0.05  # of the optimizer steps


class NoFit(ValueError):
    """No tensor-parallel size the GPUs allow holds the target; the message says by how much."""


@dataclass(frozen=True)
class Placement:
    """Where the extraction runs, and why, in one line."""

    backend: str  # "hf" or "vllm"
    tp: int  # extract.tensor_parallel_size
    gpus: int  # GPUs the run uses; 0: CPU mode
    why: str


def budget(gpu_memory: int) -> float:
    """The bytes vLLM lets itself use on one GPU of `gpu_memory` bytes."""
    return GPU_MEMORY_UTILIZATION * gpu_memory


def shard(weight_bytes: int, tp: int) -> int:
    """Weight bytes per GPU at tensor-parallel size `tp` (rounded up: no GPU holds less)."""
    return -(-weight_bytes // tp)


def fits(weight_bytes: int, tp: int, gpu_memory: int) -> bool:
    return shard(weight_bytes, tp) + MARGIN <= budget(gpu_memory)


def tp_sizes(gpus: int, heads: int | None = None) -> list[int]:
    """The TP sizes to try, smallest first: powers of two up to `gpus` (vLLM shards evenly over
    them), and only those that divide the attention heads when their number is known (vLLM
    refuses the others)."""
    sizes, t = [], 1
    while t <= gpus:
        if heads is None or heads % t == 0:
            sizes.append(t)
        t *= 2
    return sizes


def _arithmetic(weight_bytes: int, tp: int, gpu_memory: int) -> str:
    split = f"{human_bytes(weight_bytes)} of weights" + (
        f" ÷ {tp} = {human_bytes(shard(weight_bytes, tp))}" if tp > 1 else ""
    )
    return (
        f"{split} + {human_bytes(MARGIN)} margin per GPU, "
        f"{'within' if fits(weight_bytes, tp, gpu_memory) else 'over'} {human_bytes(budget(gpu_memory))} "
        f"({GPU_MEMORY_UTILIZATION} × {human_bytes(gpu_memory)})"
    )


def place(weight_bytes: int | None, gpus: int, gpu_memory: int | None, heads: int | None = None) -> Placement:
    """The smallest power-of-two TP whose shard fits one GPU; raise NoFit when none up to `gpus` does.

    TP 1 runs on the transformers backend (`hf`), data parallel with one model per GPU, so a
    target that fits one GPU uses them all; a larger TP needs vLLM (the extract stage's path for
    targets that need several GPUs). Without GPUs the run is on CPU: `hf`, TP 1.
    """
    if gpus <= 0:
        return Placement("hf", 1, 0, "no GPU: CPU mode, where the transformers backend runs one model per rank")
    if weight_bytes is None or gpu_memory is None:
        raise ValueError("weight_bytes and gpu_memory are needed to place a target on GPUs")
    sizes = tp_sizes(gpus, heads)
    for tp in sizes:
        if not fits(weight_bytes, tp, gpu_memory):
            continue
        if tp == 1:
            spread = f", data parallel over {gpus} GPUs" if gpus > 1 else ""
            why = f"tp 1: {_arithmetic(weight_bytes, 1, gpu_memory)}: one GPU holds it whole, so the hf backend{spread}"
            return Placement("hf", 1, gpus, why)
        smaller = max(t for t in sizes if t < tp)
        why = (
            f"tp {tp}: {_arithmetic(weight_bytes, tp, gpu_memory)}; tp {smaller} would need "
            f"{human_bytes(shard(weight_bytes, smaller) + MARGIN)} per GPU, over that"
        )
        return Placement("vllm", tp, gpus, why)
    largest = sizes[-1]
    limit = f" (and dividing its {heads} attention heads)" if heads is not None and largest < _pow2_floor(gpus) else ""
    raise NoFit(
        f"the target does not fit {gpus} GPU{'s' if gpus != 1 else ''} of {human_bytes(gpu_memory)}: "
        f"at tp {largest}, the largest power of two up to {gpus}{limit}, "
        f"{_arithmetic(weight_bytes, largest, gpu_memory)}"
    )


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def draft_vocab(target_vocab: int | None) -> int:
    """EAGLE-3's usual 32000, or the whole target vocabulary when it is smaller."""
    return DRAFT_VOCAB if target_vocab is None else min(DRAFT_VOCAB, target_vocab)


@dataclass(frozen=True)
class Schedule:
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int


def schedule(tokens: int, epochs: int, batch_tokens: int, ranks: int, validation_fraction: float) -> Schedule:
    """Optimizer steps from the training tokens (each step takes `batch_tokens` per rank), and a
    warmup of WARMUP_FRACTION of them."""
    train_tokens = int(tokens * (1 - validation_fraction))
    per_epoch = max(1, math.ceil(train_tokens / (batch_tokens * max(ranks, 1))))
    total = per_epoch * epochs
    return Schedule(per_epoch, total, round(total * WARMUP_FRACTION))
