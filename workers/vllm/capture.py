"""Capture the residual stream inside a vLLM worker, per request, by observation.

Hooks, never a replaced forward (speculators 0.3.0 replaced the base model's forward with a
Llama-shaped one and broke on DeepseekV2Model). The hooks sit on the layers, the embedding
and the final norm, not on the decoder module itself: vLLM's @support_torch_compile
decoders are called through a __call__ that goes straight to forward() when compilation is
off, so hooks on the decoder module never fire.
- a forward pre-hook on the embedding module notes the step's input ids (absent when a
  multimodal model passes embeddings instead);
- a forward pre-hook on decoder layer 0 starts a step: it reads the step's layout
  (layout.py: which rows belong to which request and position) and checks it against the
  positions the layer is called with and the input ids;
- a forward pre-hook on each tapped module (layer i for id i, the final norm for id N; see
  models/adapters.py) copies rows 0..T-1 of the stream entering it into a step buffer
  [T, n_ids, hidden], T the step's real token count (rows past T are padding);
- a forward hook on the final norm ends the step: the buffer's rows are scattered into
  each request's own [prompt_len, n_ids, hidden] buffer at its positions. A request whose
  every position has arrived goes to the background writer (extract/hswriter.py), which writes
  hs_<idx>.safetensors atomically.

Only real steps are captured: `observe_runner` wraps the runner's execute_model so the
hooks know when a scheduler step (not a profiling or dummy run) is under way.

Which TP rank captures: one (rank 0). After each layer's all-reduce every TP rank holds the
whole residual stream (hidden_states and residual are replicated); a stream whose row count
differs from the step's positions is sharded (sequence-parallel MoE) and is refused.

On a GPU the step buffer is pinned and the copies are asynchronous; the step's end waits
for them once, then scatters on the host.
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eyas.workers.extract import hswriter, stream
from eyas.workers.models.adapters import TAPS, Decoder
from eyas.workers.vllm import layout as vllm_layout

log = logging.getLogger("eyas.vllm_capture")


@dataclass
class Request:
    idx: int  # dataset row: names the file
    tokens: np.ndarray  # prompt token ids
    write: bool  # False: its file exists already; check it, keep nothing
    buffer: Any = None  # [len, n_ids, hidden] in the target dtype, when writing
    covered: np.ndarray = field(default=None)  # bool per position: captured yet?
    submitted: bool = False

    @property
    def length(self) -> int:
        return len(self.tokens)


class Capture:
    """Hooks on one worker's decoder; `expect()` requests, run them, then `collect()`."""

    def __init__(
        self,
        decoder: Decoder,
        layer_ids: tuple[int, ...],
        dtype,
        hs_dir: Path,
        runner: Any,
        device: Any = None,
        max_pending: int = 2,
        hidden_dtype: str = "target",
        window: Path | None = None,
    ):
        import torch

        self.torch = torch
        self.decoder = decoder
        self.layer_ids = decoder.check_ids(layer_ids)
        self.dtype = dtype
        self.device = device
        self.hidden_size = int(decoder.norm.weight.shape[-1])
        self._check_pipeline(decoder)
        self.runner = runner
        self.v2 = vllm_layout.V2Observer(runner) if vllm_layout.is_v2(runner) else None
        self.max_pending, self.hidden_dtype = max_pending, hidden_dtype
        # Streaming ([storage] mode = "streaming"): each shard lands counted in the window's
        # ledger, under its lock, as the hf backend's do (extract/stream.py: Ledger).
        self.replace = stream.Ledger(Path(window)).replace if window is not None else os.replace
        self.closed_written = self.closed_bytes = 0  # of the writers of earlier directories
        self.writer = self._writer(Path(hs_dir))
        self.requests: dict[str, Request] = {}  # external request id -> request
        self._internal: dict[str, Request] = {}  # vLLM's internal id -> request
        self.active = False  # inside a real scheduler step
        self._step: tuple | None = None  # (layout, buffer view, seen ids)
        self._buffer = None
        self.steps = 0
        self.tokens = 0
        self.max_requests = 0  # most requests seen in one step
        self.continued = 0  # segments that continue a prompt begun in an earlier step
        first = decoder.layers[0]
        self._pos_at = _index(type(first).forward, "positions")
        if self._pos_at is None:
            raise RuntimeError(
                f"{type(first).__name__}.forward takes no 'positions'; eyas maps rows to "
                "requests by the positions each decoder layer receives"
            )
        self._ids = None
        tap = TAPS["vllm"]
        embed = getattr(decoder.module, "embed_tokens", None)
        self._handles = []
        if embed is not None and hasattr(embed, "register_forward_pre_hook"):
            self._handles.append(embed.register_forward_pre_hook(self._note_ids))
        # Registered before the taps, so layer 0's step start runs before id 0's copy.
        self._handles.append(first.register_forward_pre_hook(self._begin, with_kwargs=True))
        for k, layer_id in enumerate(self.layer_ids):
            module = decoder.tap_module(layer_id)
            self._handles.append(module.register_forward_pre_hook(self._tap(k, tap.bind(module)), with_kwargs=True))
        self._handles.append(decoder.norm.register_forward_hook(self._end, with_kwargs=True))
        observe_runner(runner, self)

    @staticmethod
    def _check_pipeline(decoder: Decoder) -> None:
        start = getattr(decoder.module, "start_layer", 0)
        end = getattr(decoder.module, "end_layer", decoder.num_layers)
        if (start, end) != (0, decoder.num_layers):
            raise RuntimeError(
                f"this worker holds decoder layers {start}..{end - 1} of {decoder.num_layers}: "
                "pipeline parallelism splits the residual stream across workers; extract with "
                "tensor parallelism only (pipeline_parallel_size = 1)"
            )

    # -- requests ------------------------------------------------------------------------

    def expect(self, requests: dict[str, tuple[int, list[int], bool]]) -> None:
        """Requests about to be sent: external id -> (dataset row, prompt ids, write?). A
        request's buffer is allocated when its first rows arrive, so only the requests vLLM
        is running hold memory."""
        for rid, (idx, tokens, write) in requests.items():
            req = Request(int(idx), np.asarray(tokens, dtype=np.int64), bool(write))
            req.covered = np.zeros(req.length, dtype=bool)
            self.requests[rid] = req

    def _request(self, req_id: str) -> Request | None:
        """The request behind a vLLM internal id: vLLM appends "-<8 random chars>" to the
        id it was given (unless request-id randomization is off)."""
        req = self._internal.get(req_id)
        if req is None:
            req = self.requests.get(req_id) or self.requests.get(req_id.rpartition("-")[0])
            if req is not None:
                self._internal[req_id] = req
        return req

    def _writer(self, directory: Path) -> hswriter.HiddenStatesWriter:
        return hswriter.HiddenStatesWriter(
            directory, max_pending=self.max_pending, hidden_dtype=self.hidden_dtype, replace=self.replace
        )

    def directory(self, directory: Path) -> dict:
        """Write the next requests' files into `directory` (a streaming epoch's own folder): the
        current writer is closed first, so every file of the last folder has landed."""
        if self.writer.directory != Path(directory):
            self.writer.close()
            self.closed_written += self.writer.written
            self.closed_bytes += self.writer.bytes
            self.writer = self._writer(Path(directory))
        return {"written": self.closed_written + self.writer.written}

    def collect(self) -> dict:
        """After the requests finished: every position of every one must have been seen."""
        missing = {rid: int((~r.covered).sum()) for rid, r in self.requests.items() if not r.covered.all()}
        if missing:
            first = next(iter(missing))
            raise RuntimeError(
                f"{len(missing)} requests finished with positions never captured "
                f"(first: {first}, {missing[first]} of {self.requests[first].length} missing); "
                "the model's forward did not pass through the tapped modules for them"
            )
        done = sorted(r.idx for r in self.requests.values())
        written = sorted(r.idx for r in self.requests.values() if r.write)
        self.requests.clear()
        self._internal.clear()
        return {"samples": done, "submitted": written}

    def _detach(self) -> None:
        """Remove the hooks and the runner wrappers: the model runs as if never observed."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for name in ("execute_model", "prepare_inputs"):
            if name in vars(self.runner):  # our instance-level wrapper, over the class's method
                delattr(self.runner, name)

    def close(self) -> dict:
        self._detach()
        self.writer.close()
        return {
            "written": self.closed_written + self.writer.written,
            "bytes": self.closed_bytes + self.writer.bytes,
            "steps": self.steps,
            "tokens": self.tokens,
            "max_requests_per_step": self.max_requests,
            "continued_segments": self.continued,
        }

    def abort(self) -> None:
        self._detach()
        self.writer.abort()

    # -- hooks ---------------------------------------------------------------------------

    def _note_ids(self, module, args):
        self._ids = args[0] if args else None
        return None

    def _begin(self, module, args, kwargs):
        self._step = None
        input_ids, self._ids = self._ids, None
        if not self.active:
            return None
        positions = _arg(args, kwargs, self._pos_at, "positions")
        pos = positions.detach().cpu().numpy()
        if self.v2 is not None:
            if self.v2.last is None:
                raise vllm_layout.LayoutError("a V2 runner ran a step without prepare_inputs")
            layout = vllm_layout.read_v2(self.v2.last, pos)
        else:
            layout = vllm_layout.read_v1(self.runner, pos)
        expected = {}
        for seg in layout.segments:
            req = self._request(seg.req_id)
            if req is not None:
                expected[seg.req_id] = (req.length, req.tokens)
        ids = None if input_ids is None else input_ids.detach().cpu().numpy()
        vllm_layout.verify(layout, pos, ids, expected)
        t = layout.num_tokens
        if self._buffer is None or self._buffer.shape[0] < t:
            self._buffer = self.torch.empty(
                (max(t, 256), len(self.layer_ids), self.hidden_size), dtype=self.dtype, pin_memory=self._pinned()
            )
        self._step = (layout, self._buffer[:t], set(), pos.shape[-1])
        return None

    def _pinned(self) -> bool:
        return self.device is not None and getattr(self.device, "type", str(self.device)) == "cuda"

    def _tap(self, k: int, read):
        def hook(module, args, kwargs):
            step = self._step
            if step is None:
                return None
            layout, buf, seen, rows = step
            stream = read(args, kwargs)
            if stream.shape[0] != rows:
                raise RuntimeError(
                    f"the stream entering {type(module).__name__} has {stream.shape[0]} rows for "
                    f"{rows} positions: it is sharded across ranks (sequence-parallel MoE), "
                    "which eyas does not capture; disable sequence parallelism for extraction"
                )
            buf[:, k].copy_(stream[: layout.num_tokens], non_blocking=True)
            seen.add(k)
            return None

        return hook

    def _end(self, module, args, kwargs, output):
        step, self._step = self._step, None
        if step is None:
            return None
        layout, buf, seen, _ = step
        if len(seen) != len(self.layer_ids):
            lost = [self.layer_ids[k] for k in range(len(self.layer_ids)) if k not in seen]
            raise RuntimeError(f"layer ids {lost} were not reached by the step's forward")
        if self._pinned():
            self.torch.cuda.current_stream().synchronize()  # the copies into the pinned buffer
        self.steps += 1
        self.tokens += layout.num_tokens
        self.max_requests = max(self.max_requests, len(layout.segments))
        self.continued += sum(1 for seg in layout.segments if seg.position > 0)
        for seg in layout.segments:
            req = self._request(seg.req_id)
            end = min(seg.end, seg.start + req.length - seg.position)  # prompt rows only
            if end <= seg.start:
                continue
            n = end - seg.start
            # A preempted request is computed again from position 0: the same rows, the same
            # values; once its file is queued, a repeat is only checked, not kept.
            if req.write and not req.submitted:
                if req.buffer is None:
                    req.buffer = self.torch.empty((req.length, len(self.layer_ids), self.hidden_size), dtype=self.dtype)
                req.buffer[seg.position : seg.position + n].copy_(buf[seg.start : end])
            req.covered[seg.position : seg.position + n] = True
            if req.write and not req.submitted and req.covered.all():
                req.submitted = True
                item = hswriter.Item(idx=req.idx, row=0, length=req.length, token_ids=self.torch.from_numpy(req.tokens))
                self.writer.put(hswriter.Job(hidden=req.buffer.unsqueeze(0), items=[item]))
                req.buffer = None  # the writer owns it now
        return None


def observe_runner(runner: Any, capture: Capture) -> None:
    """Flag real scheduler steps: wrap the runner's execute_model (it calls the original
    and returns its result untouched), so profiling and dummy runs are never captured."""
    original = runner.execute_model

    def execute_model(*args, **kwargs):
        if kwargs.get("dummy_run"):
            return original(*args, **kwargs)
        capture.active = True
        try:
            return original(*args, **kwargs)
        finally:
            capture.active = False

    runner.execute_model = execute_model


def _index(fn, name: str) -> int | None:
    """Index of `name` among the positional arguments a call passes (self excluded)."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params.index(name) - 1 if name in params else None


def _arg(args: tuple, kwargs: dict, index: int | None, name: str):
    if name in kwargs:
        return kwargs[name]
    if index is not None and index < len(args):
        return args[index]
    raise RuntimeError(f"a decoder layer was called without {name!r}; eyas needs it to map rows to requests")
