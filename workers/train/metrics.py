"""Training figures: speculators' metric counts as eyas' metric names, and the throughput meter."""

from __future__ import annotations

import time


def ratios(sums: dict[str, float], prefix: str = "") -> dict[str, float]:
    """speculators' `<name>_sum` / `<name>_total` pairs as ratios under eyas' metric names:
    loss, loss_<k>, acc_<k> (full accuracy: every step up to k right) and cond_acc_<k>
    (right at step k given steps before k were right)."""
    out = {}
    for key, total in sums.items():
        if not key.endswith("_total"):
            continue
        name = key[: -len("_total")]
        if name.startswith("full_acc_"):
            name = "acc_" + name[len("full_acc_") :]
        value = sums.get(key[: -len("_total")] + "_sum")
        if value is not None:
            out[prefix + name] = value / total if total > 0 else float("nan")
    return out


class Meter:
    """Wall time in the training loop, step to step: each step is charged from the end of the
    one before, so the data loading between them counts. The attempt's first step (warm-up:
    allocations, first-touch) does not count, nor anything done between `resume()` calls."""

    def __init__(self):
        self.steps = 0
        self.tokens = 0  # timed tokens (first step left out)
        self.all_tokens = 0
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # the process' CPU time over the same spans, every thread's
        self._last = time.perf_counter()
        self._last_cpu = time.process_time()

    def resume(self) -> None:
        self._last = time.perf_counter()
        self._last_cpu = time.process_time()

    def elapsed(self) -> float:
        return time.perf_counter() - self._last

    def step(self, tokens: int) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        if self.steps:
            self.seconds += now - self._last
            self.cpu_seconds += cpu - self._last_cpu
            self.tokens += tokens
        self.steps += 1
        self.all_tokens += tokens
        self._last, self._last_cpu = now, cpu
