"""Which request and position each token of a vLLM step belongs to.

vLLM flattens every scheduled request of a step into one token dimension: request i owns
rows query_start_loc[i]:query_start_loc[i+1], in the order of the model runner's batch
(not the order of scheduler_output, which is a dict), and a long prompt may be split across
steps (chunked prefill), so its rows start at its number of computed tokens, not at 0.
Capturing per sample therefore needs the step's real layout. speculators issue #279 (silently
wrong hidden states with batch > 1) is what guessing it costs.

Here the layout is read from the model runner and then *checked* against what the model
itself receives: each segment's positions must count up by one from where the request
stands, and its input ids must be the request's own prompt tokens at those positions. A
layout that fails the check raises; no state is ever written from an unverified layout.

Runners (vLLM 0.32, the CPU build; 0.33 on GPUs):
- V1 (`vllm/v1/worker/gpu_model_runner.py`, CPUModelRunner subclasses it): the persistent
  `runner.input_batch.req_ids[:num_reqs]` and `runner.query_start_loc.np`, both set by
  `_prepare_inputs` before the forward.
- V2 (`vllm/v1/worker/gpu/model_runner.py`, the default on GPUs with Triton): the step's
  `InputBatch` is returned by `runner.prepare_inputs()` and not kept, so `observe_v2`
  wraps that method to keep the last one (it calls the original and returns its result
  untouched). Not exercised on CPU (V2 needs Triton).
numpy only (and whatever tensors it is given).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


class LayoutError(RuntimeError):
    """The step's layout cannot be read or does not match what the model received."""


@dataclass(frozen=True)
class Segment:
    req_id: str  # vLLM's internal request id
    start: int  # first row of the step's flattened tokens
    end: int  # one past its last row
    position: int  # the prompt position of row `start`


@dataclass(frozen=True)
class StepLayout:
    segments: tuple[Segment, ...]
    num_tokens: int  # real (unpadded) tokens of the step

    @classmethod
    def from_arrays(cls, req_ids, query_start_loc, positions) -> StepLayout:
        """Segments from req ids in batch order, cumulative token counts and positions."""
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        if len(qsl) != len(req_ids) + 1 or qsl[0] != 0 or (np.diff(qsl) < 0).any():
            raise LayoutError(f"query_start_loc {qsl.tolist()} does not fit {len(req_ids)} requests")
        pos = np.asarray(positions)
        if pos.ndim == 2:  # M-RoPE positions [3, tokens]: text tokens carry one position in every row
            pos = pos[0]
        total = int(qsl[-1])
        if pos.shape[0] < total:
            raise LayoutError(f"the step schedules {total} tokens but the model got {pos.shape[0]} positions")
        segments = tuple(
            Segment(str(r), int(a), int(b), int(pos[a]) if b > a else 0) for r, a, b in zip(req_ids, qsl[:-1], qsl[1:])
        )
        return cls(segments, total)


def read_v1(runner: Any, positions) -> StepLayout:
    """The layout of the step a V1 model runner is about to run."""
    try:
        batch = runner.input_batch
        n = int(batch.num_reqs)
        req_ids = list(batch.req_ids[:n])
        qsl = runner.query_start_loc.np[: n + 1]
    except AttributeError as exc:
        raise LayoutError(
            f"{type(runner).__name__} has no V1 batch layout ({exc}); eyas reads "
            "input_batch.req_ids and query_start_loc of vLLM 0.32/0.33 runners"
        ) from None
    return StepLayout.from_arrays(req_ids, qsl, positions)


def read_v2(input_batch: Any, positions) -> StepLayout:
    """The layout of a V2 runner's step, from the InputBatch its prepare_inputs returned."""
    try:
        n = int(input_batch.num_reqs)
        req_ids = list(input_batch.req_ids[:n])
        qsl = np.asarray(input_batch.query_start_loc_np)[: n + 1]
    except AttributeError as exc:
        raise LayoutError(f"{type(input_batch).__name__} has no V2 batch layout ({exc})") from None
    return StepLayout.from_arrays(req_ids, qsl, positions)


class V2Observer:
    """Keeps the InputBatch of a V2 runner's current step (wraps `prepare_inputs`)."""

    def __init__(self, runner: Any):
        self.last = None
        original = runner.prepare_inputs

        def prepare_inputs(*args, **kwargs):
            batch = original(*args, **kwargs)
            self.last = batch
            return batch

        runner.prepare_inputs = prepare_inputs


def is_v2(runner: Any) -> bool:
    """V2 runners keep no persistent input_batch; they build one per step in prepare_inputs."""
    return not hasattr(runner, "input_batch") and hasattr(runner, "prepare_inputs")


def verify(layout: StepLayout, positions, input_ids, expected: dict[str, tuple[int, Any]]) -> None:
    """Check every segment against the model's inputs: positions count up by one, and the
    ids at those positions are the request's own prompt tokens.

    `expected` maps a req id to (prompt length, prompt token ids as a numpy array). A
    segment of a request not in `expected` is an error: eyas sends every request itself.
    """
    pos = np.asarray(positions)
    if pos.ndim == 2:
        pos = pos[0]
    ids = None if input_ids is None else np.asarray(input_ids)
    for seg in layout.segments:
        if seg.req_id not in expected:
            raise LayoutError(f"step holds request {seg.req_id!r}, which eyas did not send")
        length, tokens = expected[seg.req_id]
        p = pos[seg.start : seg.end]
        n = seg.end - seg.start
        if n and not np.array_equal(p, np.arange(seg.position, seg.position + n)):
            raise LayoutError(
                f"request {seg.req_id}: rows {seg.start}:{seg.end} carry positions "
                f"{_short(p)}, not {seg.position}..{seg.position + n - 1}: the step layout "
                "read from the runner does not match the model's inputs"
            )
        # Rows at or past the prompt's end are generated tokens (none with max_tokens=1).
        k = max(0, min(seg.end, seg.start + length - seg.position) - seg.start)
        if (
            ids is not None
            and k
            and not np.array_equal(ids[seg.start : seg.start + k], tokens[seg.position : seg.position + k])
        ):
            raise LayoutError(
                f"request {seg.req_id}: rows {seg.start}:{seg.start + k} carry token ids "
                f"{_short(ids[seg.start : seg.start + k])}, not its prompt's "
                f"{_short(tokens[seg.position : seg.position + k])}: the step layout read from "
                "the runner does not match the model's inputs"
            )


def _short(a) -> str:
    a = np.asarray(a).tolist()
    return str(a) if len(a) <= 8 else f"[{', '.join(map(str, a[:4]))}, ..., {', '.join(map(str, a[-2:]))}]"
