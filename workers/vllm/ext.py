"""eyas's vLLM worker extension: supervision and capture inside each tensor-parallel worker.

vLLM imports this module inside every worker process (`worker_extension_cls`), before the
worker initialises its device or loads a single weight. Importing it there:
- registers the worker with the daemon: `<EYAS_ATTEMPT_DIR>/tp-<k>.proc.json`
  {tp_rank, rank, pid, create_time, device, host, driver_rank, time} (atomic), so the daemon
  tracks, samples and tears down the worker as a rank of the attempt from the start of an
  hours-long load, not after it;
- makes every failure in the worker land in `tp-<k>.error.json` (the rank error-file
  schema, plus tp_rank and role) *before* vLLM flattens it: vLLM logs a worker's exception
  with its traceback and then sends the driver only str(exc), which for an empty message
  reads `Worker failed with error ''`. A logging handler on the "vllm" logger records the
  first exception logged at ERROR; sys.excepthook and threading.excepthook catch anything
  uncaught; eyas's own RPC methods record theirs directly. The first error is kept;
- prefixes the worker's plain prints (Python's stdout and stderr) with
  `(Worker_TP<k> pid=<p>)` as vLLM prefixes its log records, so the daemon can put every
  line of the worker in that worker's log. Writes below Python (C++ warnings) cannot be
  prefixed and stay with the driver.

The TP rank at import time comes from the process name vLLM gives its workers,
`VllmWorker-<rank>` (multiprocessing's name, set before the process starts; the same in
vLLM 0.32 and 0.33). With pipeline parallelism off, which eyas requires, rank == TP rank.
`eyas_setup` registers again from the worker's own rank, in case the name ever changes.

The RPC methods (all named eyas_*, since vLLM refuses an extension whose names collide with
the worker's): eyas_setup, eyas_expect, eyas_collect, eyas_finish. Every reply is a dict, so a
list that comes back from collective_rpc is always one reply per rank (engine.replies).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import re
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from eyas.state import contract
from eyas.workers.runtime import atomic

log = logging.getLogger("eyas.vllm_ext")

_WORKER_NAME = re.compile(r"VllmWorker-(\d+)")
# Python's own traceback, which vLLM adds to an exception as a note before logging it.
_TRACEBACK_NOTE = "Traceback (most recent call last)"

_state: dict[str, Any] = {"tp_rank": None, "error_written": False}
_lock = threading.Lock()


def attempt_dir() -> Path | None:
    """Where this worker's tp-<k> files go: the attempt directory, or its driver's folder in it
    when its driver is not rank 0 (contract.tp_dir_name)."""
    raw = os.environ.get(contract.ATTEMPT_DIR)
    if not raw:
        return None
    sub = contract.tp_dir_name(_int(os.environ.get(contract.RANK)))
    if sub is None:
        return Path(raw)
    path = Path(raw) / sub
    path.mkdir(exist_ok=True)
    return path


def _device(local_rank: int) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v for v in visible.split(",") if v.strip()]
        if local_rank < len(ids):
            return ids[local_rank].strip()
    return "cpu"


def register(tp_rank: int, rank: int | None = None, device: str | None = None) -> None:
    """Write tp-<k>.proc.json and install the error and output hooks (idempotent)."""
    directory = attempt_dir()
    if directory is None:
        return
    import psutil

    first = _state["tp_rank"] is None
    _state["tp_rank"] = tp_rank
    record = {
        "tp_rank": tp_rank,
        "rank": tp_rank if rank is None else rank,
        "pid": os.getpid(),
        "create_time": psutil.Process().create_time(),
        "device": device or _device(tp_rank),
        "host": socket.gethostname(),
        "driver_rank": _int(os.environ.get(contract.RANK)),
        "time": time.time(),
    }
    try:
        atomic.write_json(directory / contract.tp_file(tp_rank, contract.PROC), record)
    except OSError as exc:
        print(
            f"eyas: TP rank {tp_rank}: could not write {contract.tp_file(tp_rank, contract.PROC)}: {exc}",
            file=sys.stderr,
            flush=True,
        )
    if first:
        _install_hooks(tp_rank)


def _int(raw: str | None) -> int | None:
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def _format(exc: BaseException) -> str:
    """The exception's traceback, chained causes included, without the copy of itself that
    vLLM attaches as a note."""
    te = traceback.TracebackException.from_exception(exc)
    notes = getattr(te, "__notes__", None)
    if notes:
        te.__notes__ = [n for n in notes if not str(n).startswith(_TRACEBACK_NOTE)]
    return "".join(te.format())


def record_error(exc: BaseException, where: str = "") -> None:
    """Write tp-<k>.error.json for `exc` unless this worker has recorded one already."""
    directory, tp_rank = attempt_dir(), _state["tp_rank"]
    if directory is None or tp_rank is None:
        return
    with _lock:
        if _state["error_written"]:
            return
        _state["error_written"] = True
    from eyas.workers.runtime import rank as runtime

    record = runtime.error_record(
        exc, rank=None, stage=os.environ.get(contract.STAGE), attempt=_int(os.environ.get(contract.ATTEMPT))
    )
    record.update(
        traceback=_format(exc),
        tp_rank=tp_rank,
        role="tp-worker",
        driver_rank=_int(os.environ.get(contract.RANK)),
        where=where,
    )
    runtime.write_error(directory / contract.tp_file(tp_rank, contract.ERROR), record)


class _ErrorHandler(logging.Handler):
    """vLLM logs a worker's exception (logger.exception) before it flattens it into a
    string for the driver: this handler is where the full record is taken."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            try:
                record_error(exc, where=f"{record.name}: {record.getMessage()}")
            except Exception:  # noqa: BLE001 - reporting must never break the worker
                pass


class _Prefixed:
    """A text stream that writes whole lines, each prefixed with the worker's name.

    Lines are written one write() each, so they never interleave with another process's
    lines in the shared log. A line that already carries a vLLM prefix is left alone.
    """

    def __init__(self, stream, prefix: str):
        self._stream = stream
        self._prefix = prefix
        self._partial = ""
        self._lock = threading.Lock()  # threads print too; the partial line is shared

    def write(self, text: str) -> int:
        with self._lock:
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
            if lines:
                self._stream.write(
                    "".join(
                        line + "\n" if line.startswith("(") and " pid=" in line[:64] else self._prefix + line + "\n"
                        for line in lines
                    )
                )
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def close_partial(self) -> None:
        with self._lock:
            if self._partial:
                self._stream.write(self._prefix + self._partial + "\n")
                self._partial = ""
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _install_hooks(tp_rank: int) -> None:
    logging.getLogger("vllm").addHandler(_ErrorHandler())
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        record_error(value, where="uncaught")
        previous(kind, value, tb)

    sys.excepthook = excepthook
    previous_thread = threading.excepthook

    def thread_excepthook(args):
        if args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
            record_error(args.exc_value, where=f"thread {getattr(args.thread, 'name', '?')}")
        previous_thread(args)

    threading.excepthook = thread_excepthook
    prefix = f"(Worker_TP{tp_rank} pid={os.getpid()}) "
    streams = []
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Prefixed):
            wrapped = _Prefixed(stream, prefix)
            setattr(sys, name, wrapped)
            streams.append(wrapped)
    # multiprocessing's exit path runs its finalizers (atexit does not run in a forked child).
    from multiprocessing import util

    util.Finalize(None, lambda: [s.close_partial() for s in streams], exitpriority=100)


def _register_from_process_name() -> None:
    match = _WORKER_NAME.fullmatch(multiprocessing.current_process().name or "")
    if match and attempt_dir() is not None:
        register(int(match.group(1)))


_register_from_process_name()


def _recorded(method):
    """Record an exception of an eyas RPC method before vLLM sees it."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            record_error(exc, where=method.__name__)
            raise

    return wrapper


class EyasWorkerExtension:
    """Mixed into vLLM's worker class (vLLM appends it to the worker's bases)."""

    @_recorded
    def eyas_setup(self, spec: dict) -> dict:
        """Resolve the decoder through the adapters, install the hooks on the writing rank."""
        import torch

        from eyas.workers.models import adapters
        from eyas.workers.vllm.capture import Capture

        register(int(self.rank), int(self.rank), _device_name(getattr(self, "device", None)))
        model = self.get_model()
        adapter, decoder = adapters.resolve(model, spec["architecture"], backend="vllm")
        layer_ids = decoder.check_ids(spec["layer_ids"])
        embed = decoder.api("embed", "vllm")  # the real API of this family, checked on the loaded class
        for layer_id in layer_ids:  # each tapped class's signature, checked once
            adapters.TAPS["vllm"].bind(decoder.tap_module(layer_id))
        dtype = getattr(torch, spec["dtype"])
        writer = int(self.rank) == int(spec.get("writer_rank", 0))
        previous = getattr(self, "_eyas_capture", None)
        if previous is not None:  # set up again (a new output dir): the old hooks go first
            previous.abort()
            self._eyas_capture = None
        if writer:
            self._eyas_capture = Capture(
                decoder,
                layer_ids,
                dtype,
                Path(spec["hs_dir"]),
                self.model_runner,
                device=getattr(self, "device", None),
                max_pending=int(spec.get("max_pending", 2)),
                hidden_dtype=spec.get("hidden_dtype", "target"),
                window=Path(spec["window"]) if spec.get("window") else None,
            )
        layer = decoder.layers[0]
        return {
            "tp_rank": int(self.rank),
            "pid": os.getpid(),
            "writer": writer,
            "adapter": adapter.family,
            "model_class": type(model).__name__,
            "decoder_class": type(decoder.module).__name__,
            "layer_class": type(layer).__name__,
            "decoder_path": decoder.path,
            "num_layers": decoder.num_layers,
            "hidden_size": int(decoder.norm.weight.shape[-1]),
            "embed_api": embed.__name__,
            "runner": "v2" if not hasattr(self.model_runner, "input_batch") else "v1",
            "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        }

    @_recorded
    def eyas_expect(self, requests: dict) -> dict:
        capture = getattr(self, "_eyas_capture", None)
        if capture is not None:
            capture.expect(requests)
        return {"tp_rank": int(self.rank), "expected": len(requests) if capture is not None else 0}

    @_recorded
    def eyas_directory(self, path: str) -> dict:
        """Streaming: the next requests' files go into `path` (workers/vllm/streaming.py)."""
        capture = getattr(self, "_eyas_capture", None)
        out = capture.directory(Path(path)) if capture is not None else {}
        return {"tp_rank": int(self.rank), **out}

    @_recorded
    def eyas_written(self) -> dict:
        """Files the writer has landed so far, in the order their requests were sent."""
        capture = getattr(self, "_eyas_capture", None)
        written = capture.closed_written + capture.writer.written if capture is not None else 0
        return {"tp_rank": int(self.rank), "written": written}

    @_recorded
    def eyas_collect(self) -> dict:
        capture = getattr(self, "_eyas_capture", None)
        out = capture.collect() if capture is not None else {}
        return {"tp_rank": int(self.rank), **out}

    @_recorded
    def eyas_finish(self) -> dict:
        capture = getattr(self, "_eyas_capture", None)
        if capture is None:
            return {"tp_rank": int(self.rank)}
        self._eyas_capture = None
        return {"tp_rank": int(self.rank), **capture.close()}


def _device_name(device: Any) -> str | None:
    if device is None:
        return None
    if getattr(device, "type", None) == "cuda":
        index = getattr(device, "index", None)
        return _device(index or 0)
    return str(getattr(device, "type", device))
