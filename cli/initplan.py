"""The arithmetic of `eyas init`: where the extraction runs (backend, tensor-parallel size, ranks), as pure functions of the target's numbers and the GPUs', and the words for the training schedule state/trainsteps.py sizes to the data.

No file, no NVML, no engine: cli/init.py reads the target and counts the GPUs, this module
decides, and its tests feed it numbers. Every decision carries the sentence that justifies it,
which init writes beside the key.

The fit rule is `eyas doctor`'s memory check, not one of init's own: for each TP, init asks a
`Judge` (cli/init.py builds it on workers/doctor/memoryestimate.py's estimate) what one GPU of the
extraction the config describes would need and what the engine may use there, and picks the
smallest TP whose need is within it. So what init picks passes the doctor's memory check on
idle GPUs, and init refuses exactly when no TP up to the GPU count does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eyas.state import trainsteps
from eyas.workers.doctor.check import human_bytes

DRAFT_VOCAB = 32000  # EAGLE-3's usual draft vocabulary (speculators' default)


class NoFit(ValueError):
    """No tensor-parallel size the GPUs allow holds the target; the message says by how much."""


@dataclass(frozen=True)
class Fit:
    """One GPU of the extraction at one TP, as the doctor's memory check judges it."""

    need: int  # bytes one GPU needs (the doctor's Need.total)
    room: int  # bytes the engine may use there (vLLM: gpu_memory_utilization × the card; hf: the card)
    arithmetic: str  # the need in parts: "weights 68.38 GB/GPU (547.00 GB ÷ TP 8) + ... = 74.29 GB"
    room_text: str  # the room and its source: "what vLLM may use, 0.92 × 80.00 GB = 73.60 GB (...)"

    @property
    def fits(self) -> bool:
        return self.need <= self.room

    def sentence(self) -> str:
        return f"{self.arithmetic}, {'within' if self.fits else 'over'} {self.room_text}"


# What one GPU needs at a TP, and what it may use: TP 1 on the hf backend, a larger TP on vLLM.
Judge = Callable[[int], Fit]


@dataclass(frozen=True)
class Placement:
    """Where the extraction runs, and why, in one line."""

    backend: str  # "hf" or "vllm"
    tp: int  # extract.tensor_parallel_size
    gpus: int  # GPUs the run uses; 0: CPU mode
    why: str


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


def place(gpus: int, judge: Judge | None, gpu_memory: int | None = None, heads: int | None = None) -> Placement:
    """The smallest power-of-two TP whose GPU `judge` says fits; raise NoFit when none up to `gpus` does.

    TP 1 runs on the transformers backend (`hf`), data parallel with one model per GPU, so a
    target that fits one GPU uses them all; a larger TP needs vLLM (the extract stage's path for
    targets that need several GPUs). Without GPUs the run is on CPU: `hf`, TP 1. `gpu_memory`
    (bytes per GPU) only names the GPUs in NoFit's message.
    """
    if gpus <= 0:
        return Placement("hf", 1, 0, "no GPU: CPU mode, where the transformers backend runs one model per rank")
    if judge is None:
        raise ValueError("a judge of each TP's memory is needed to place a target on GPUs")
    sizes = tp_sizes(gpus, heads)
    fits: dict[int, Fit] = {}
    for tp in sizes:
        fits[tp] = fit = judge(tp)
        if not fit.fits:
            continue
        if tp == 1:
            spread = f", data parallel over {gpus} GPUs" if gpus > 1 else ""
            why = f"tp 1: {fit.sentence()}: one GPU holds it whole, so the hf backend{spread}"
            return Placement("hf", 1, gpus, why)
        smaller = max(t for t in sizes if t < tp)
        why = (
            f"tp {tp}: {fit.sentence()}; tp {smaller} would need "
            f"{human_bytes(fits[smaller].need)} per GPU, over {fits[smaller].room_text}"
        )
        return Placement("vllm", tp, gpus, why)
    largest = sizes[-1]
    limit = f" (and dividing its {heads} attention heads)" if heads is not None and largest < _pow2_floor(gpus) else ""
    of = f" of {human_bytes(gpu_memory)}" if gpu_memory is not None else ""
    raise NoFit(
        f"the target does not fit {gpus} GPU{'s' if gpus != 1 else ''}{of}: "
        f"at tp {largest}, the largest power of two up to {gpus}{limit}, {fits[largest].sentence()}"
    )


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def draft_vocab(target_vocab: int | None) -> int:
    """EAGLE-3's usual 32000, or the whole target vocabulary when it is smaller."""
    return DRAFT_VOCAB if target_vocab is None else min(DRAFT_VOCAB, target_vocab)


def train_keys(sched: trainsteps.Schedule) -> list[tuple[str, Any, str]]:
    """[train]'s sized keys as (key, value, why), in the order init writes them."""
    steps = f"~{sched.total_steps} steps: {sched.epochs} epochs × ~{sched.steps_per_epoch}"
    low, high = trainsteps.LR_RANGE
    lr_why = (
        f"{_sci(high)} × √({trainsteps.MIN_STEPS} ÷ {sched.total_steps} steps), within {_sci(low)}..{_sci(high)}: "
        "the shorter the run, the longer its steps; AdamW, then decay"
    )
    return [
        ("epochs", sched.epochs, f"passes over the data: {steps} steps an epoch"),
        ("lr", sched.lr, lr_why),
        ("batch_tokens", sched.batch_tokens, "samples packed up to this many tokens per rank and step"),
        ("warmup_steps", sched.warmup_steps, f"{trainsteps.WARMUP_FRACTION:.0%} of the ~{sched.total_steps} steps"),
    ]


def _sci(x: float) -> str:
    return f"{x:.0e}".replace("e-0", "e-")


def sizing_comment(sched: trainsteps.Schedule, rows: int, source: str) -> str:
    """The sentences above [train]'s keys: the rule, what it was applied to, and (for data that
    is not too small) how it came to these values."""
    outcome = "" if sched.too_small else f" {sched.why[0].upper()}{sched.why[1:]}."
    return (
        f'Sized to the data (docs/configuration.md, "Sizing training to the data"): at least {trainsteps.MIN_STEPS} optimizer '
        f"steps, counted with training's own packing on {rows} training rows of ~{sched.tokens} tokens, {source}."
        f"{outcome} eyas validate counts the steps again, on the prepared dataset once prepare has run."
    )


def too_small(sched: trainsteps.Schedule, answer_tokens: int, ranks: int) -> str:
    """What init says, in the file and on the terminal, of data too small for a useful draft."""
    need = trainsteps.too_small_tokens(ranks, sched.batch_tokens)
    return (
        f"the data is too small for a useful draft: ~{sched.tokens} training tokens (~{answer_tokens} of "
        f"assistant answers); {sched.why}. This schedule stops at {sched.epochs} epochs, ~{sched.total_steps} "
        f"steps. About {need} training tokens or more reach {trainsteps.MIN_STEPS} steps within "
        f"{trainsteps.MAX_EPOCHS} epochs: add data"
    )
