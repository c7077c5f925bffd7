"""How many optimizer steps a run's training takes, counted with the packing training uses, and the schedule (`size`) that `eyas init` writes and `eyas validate` proposes so that a run takes at least MIN_STEPS of them.

The train stage packs each epoch with speculators' MultipackDistributedBatchSamplerV2
(workers/train/data.py: plan): the training rows' lengths, clipped to `batch_tokens`, in a seeded
shuffle, cut into consecutive runs of samples that LPT places into one bin of `batch_tokens` per
rank; each run is one optimizer step on every rank, and fewer rows than ranks left at the end are
dropped. `pack` is that algorithm in pure Python, batch for batch the same for the same order
(tests/unit/state/test_trainsteps.py holds it to speculators' own). The order is the one thing
not reproduced: training shuffles with numpy's generator, this module with the stdlib's (eyas.state
loads no numpy), so an epoch's count may differ from the run's by a few percent (3 % at most over
random datasets in tests/unit/state/test_trainsteps.py).

The rule `size` applies, and why (docs/configuration.md, "Sizing training to the data"):
- at least MIN_STEPS optimizer steps, a floor rather than a target: the 60-chat run of issue 35
  trained 3 and its validation accuracy stayed 0.00, where the demo's 300 chats reach 0.43 on the
  first draft token in 253 steps (and the demo's own config 0.51 in 160 at a higher lr);
- batch_tokens: the run config's 8192 (speculators' total_seq_len) while 3 epochs reach
  MIN_STEPS; else the largest power of two whose 3 epochs do, down to MIN_BATCH_TOKENS (several
  samples a step) or the longest sample (none is cut), whichever is larger;
- epochs: 3, or as many as MIN_STEPS needs at that floor, at most MAX_EPOCHS (speculators'
  default epoch count); data that would need more is too small for a useful draft: the sized
  schedule stops at MAX_EPOCHS, below MIN_STEPS, and says so;
- lr: by the schedule's length, 1e-3 × √(MIN_STEPS ÷ steps) within [1e-4, 1e-3]: speculators'
  default 1e-3 for the shortest schedule the rule writes, the run config's (and SpecForge's) 1e-4
  from 20,000 steps on. A short schedule needs long steps to move the draft at all: on the demo's
  300 chats (253 steps of 1024 tokens) the validation accuracy of the first draft token reached
  0.43 at 1e-3, 0.28 at 3.5e-4, 0.09 at 1e-4 and 0.002 at 3.5e-5;
- warmup: WARMUP_FRACTION of the steps.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

MIN_STEPS = 200
MAX_EPOCHS = 20  # speculators' default `epochs`
DEFAULT_EPOCHS = 3  # the run config's train.epochs
DEFAULT_BATCH_TOKENS = 8192  # the run config's train.batch_tokens, speculators' total_seq_len
MIN_BATCH_TOKENS = 1024
LR_RANGE = (1e-4, 1e-3)  # the run config's train.lr; speculators' default lr
WARMUP_FRACTION = 0.05
# Past this many rows an epoch is packed on PACK_ROWS of them drawn at random and scaled: the
# count is then far above MIN_STEPS, and packing a million rows in Python takes seconds an epoch.
PACK_ROWS = 100_000


def pack(lengths: Sequence[int], batch_tokens: int, world_size: int, rank: int = 0) -> list[list[int]]:
    """One epoch's batches of `rank` (indices into `lengths`, taken in the given order), as
    speculators' `_assign_to_packed_batches` makes them from lengths clipped to `batch_tokens`:
    for each step, the longest run of the next samples (binary search) that LPT fits into
    `world_size` bins of `batch_tokens`; stops when fewer than `world_size` samples are left."""
    sizes = [min(max(int(n), 0), batch_tokens) for n in lengths]
    cumsum = list(accumulate(sizes))
    result: list[list[int]] = []
    ind, so_far = 0, 0
    while len(sizes) - ind >= world_size:
        left = 1
        right = 1 + bisect_right(cumsum, so_far + batch_tokens * world_size, lo=ind) - ind
        rotation = len(result)
        batch = None
        while right - left > 1 and right > world_size:
            mid = (left + right) // 2
            batch = _lpt(sizes, ind, mid, batch_tokens, world_size, rank, rotation)
            if batch is None:
                right = mid
            else:
                left = mid
        if batch is None:
            batch = _lpt(sizes, ind, left, batch_tokens, world_size, rank, rotation) or []
        ind += left
        so_far = cumsum[ind - 1]
        result.append(batch)
    return result


def _lpt(sizes: list[int], start: int, count: int, budget: int, bins: int, rank: int, rotation: int):
    """speculators' `_lpt_packed_batch`: the samples start..start+count-1, longest first (numpy's
    stable argsort, reversed), each into the least full bin (ties: the lowest slot); None when one
    does not fit; else the indices that land in `rank`'s slot."""
    chunk = sizes[start : start + count]
    order = sorted(range(count), key=chunk.__getitem__)[::-1]
    heap = [(0, slot) for slot in range(bins)]
    target = (rank - rotation) % bins
    mine = []
    for i in order:
        fill, slot = heap[0]
        if fill + chunk[i] > budget:
            return None
        if slot == target:
            mine.append(start + i)
        heapq.heapreplace(heap, (fill + chunk[i], slot))
    return mine


def epoch_steps(lengths: Sequence[int], batch_tokens: int, world_size: int, seed: int = 0, epoch: int = 0) -> int:
    """Optimizer steps of one epoch over the training rows' `lengths` (a seeded stdlib shuffle,
    as training shuffles with seed + epoch); 0 when there are fewer rows than ranks."""
    if len(lengths) < world_size or world_size < 1:
        return 0
    rng, n = random.Random(seed + epoch), len(lengths)
    if n > PACK_ROWS:  # PACK_ROWS rows drawn at random, in random order: a shuffle's prefix
        part = rng.sample(range(n), PACK_ROWS)
    else:
        part = list(range(n))
        rng.shuffle(part)
    if world_size == 1:  # one bin: LPT fits a run of samples iff their sum does
        steps = _greedy_steps([min(lengths[i], batch_tokens) for i in part], batch_tokens)
    else:
        steps = len(pack([lengths[i] for i in part], batch_tokens, world_size))
    return steps if len(part) == n else round(steps * n / len(part))


def _greedy_steps(sizes: list[int], budget: int) -> int:
    steps, fill = 0, None
    for n in sizes:
        if fill is None or fill + n > budget:
            steps, fill = steps + 1, n
        else:
            fill += n
    return steps


def total_steps(lengths: Sequence[int], batch_tokens: int, world_size: int, epochs: int, seed: int = 0) -> int:
    """Optimizer steps over `epochs` epochs (each epoch its own shuffle, as in training; past
    MIN_STEPS an epoch, the first epoch's count times `epochs`: the shuffles move it by a few percent)."""
    first = epoch_steps(lengths, batch_tokens, world_size, seed, 0)
    if first >= MIN_STEPS:
        return first * epochs
    return first + sum(epoch_steps(lengths, batch_tokens, world_size, seed, e) for e in range(1, epochs))


def validation_rows(n: int, fraction: float, seed: int) -> list[int]:
    """The rows prepare holds out (workers/stages/prepare.py: validation_rows, the same rule):
    round(n × fraction), at least 1 when fraction > 0, never all n, by the hash of (seed, row)."""
    if fraction <= 0 or n < 2:
        return []
    k = min(n - 1, max(1, round(n * fraction)))
    order = sorted(range(n), key=lambda i: hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest())
    return sorted(order[:k])


def training_lengths(lengths: Sequence[int], fraction: float, seed: int) -> list[int]:
    """The lengths of the rows training packs: all but prepare's validation rows."""
    held = set(validation_rows(len(lengths), fraction, seed))
    return [n for i, n in enumerate(lengths) if i not in held]


def lr_for(steps: int) -> float:
    """LR_RANGE's top × √(MIN_STEPS ÷ steps), within LR_RANGE; two significant digits."""
    lr = LR_RANGE[1] * math.sqrt(MIN_STEPS / max(steps, 1))
    return float(f"{min(max(lr, LR_RANGE[0]), LR_RANGE[1]):.2g}")


def warmup_for(steps: int) -> int:
    return round(steps * WARMUP_FRACTION)


def batch_floor(lengths: Sequence[int]) -> int:
    """The smallest batch_tokens the rule uses: MIN_BATCH_TOKENS, or the longest sample rounded
    up to a power of two (training would cut a sample longer than batch_tokens)."""
    longest = max(lengths, default=1)
    return max(MIN_BATCH_TOKENS, 1 << max(longest - 1, 0).bit_length())


@dataclass(frozen=True)
class Schedule:
    """The training keys `size` chooses, the steps they make, and whether the data is too small."""

    epochs: int
    batch_tokens: int
    lr: float
    warmup_steps: int
    steps_per_epoch: int  # of the first epoch
    total_steps: int
    too_small: bool
    tokens: int  # the training rows' tokens, as packed (clipped to batch_tokens)
    why: str  # how the rule reached these values, one sentence


def size(lengths: Sequence[int], ranks: int, seed: int = 0) -> Schedule:
    """The schedule of the module's rule for training rows of these token `lengths` on `ranks` ranks."""
    ranks = max(ranks, 1)
    top = max(DEFAULT_BATCH_TOKENS, batch_floor(lengths))
    floor = batch_floor(lengths)
    b = top
    while True:
        if total_steps(lengths, b, ranks, DEFAULT_EPOCHS, seed) >= MIN_STEPS:
            why = (
                f"{DEFAULT_EPOCHS} epochs at batch_tokens {b} reach {MIN_STEPS} steps"
                if b == top
                else f"batch_tokens {b * 2} would give fewer than {MIN_STEPS} steps in {DEFAULT_EPOCHS} epochs"
            )
            return _schedule(lengths, ranks, seed, DEFAULT_EPOCHS, b, False, why)
        if b // 2 < floor:
            break
        b //= 2
    b = floor
    per_epoch = epoch_steps(lengths, b, ranks, seed)
    epochs = max(DEFAULT_EPOCHS, math.ceil(MIN_STEPS / max(per_epoch, 1)))
    while epochs <= MAX_EPOCHS and total_steps(lengths, b, ranks, epochs, seed) < MIN_STEPS:
        epochs += 1  # the shuffles of later epochs may pack a step fewer
    if epochs <= MAX_EPOCHS:
        why = f"~{per_epoch} steps an epoch at batch_tokens {b} (the smallest the rule uses) need {epochs} epochs"
        return _schedule(lengths, ranks, seed, epochs, b, False, why)
    why = (
        f"~{per_epoch} steps an epoch even at batch_tokens {b} (the smallest the rule uses): {MIN_STEPS} steps "
        f"would take {math.ceil(MIN_STEPS / max(per_epoch, 1))} epochs over the same tokens, more than {MAX_EPOCHS}"
    )
    return _schedule(lengths, ranks, seed, MAX_EPOCHS, b, True, why)


def _schedule(lengths, ranks: int, seed: int, epochs: int, b: int, too_small: bool, why: str) -> Schedule:
    total = total_steps(lengths, b, ranks, epochs, seed)
    return Schedule(
        epochs=epochs,
        batch_tokens=b,
        lr=lr_for(total),
        warmup_steps=warmup_for(total),
        steps_per_epoch=epoch_steps(lengths, b, ranks, seed),
        total_steps=total,
        too_small=too_small,
        tokens=sum(min(n, b) for n in lengths),
        why=why,
    )


def too_small_tokens(ranks: int, batch_tokens: int = MIN_BATCH_TOKENS) -> int:
    """About the fewest training tokens that reach MIN_STEPS within MAX_EPOCHS at `batch_tokens`
    per rank, packed perfectly: the threshold docs/configuration.md states (10,240 on one rank)."""
    return math.ceil(MIN_STEPS / MAX_EPOCHS) * batch_tokens * max(ranks, 1)
