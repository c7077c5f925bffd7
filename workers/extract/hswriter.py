"""The background writer of hidden-states files (speculators' offline format).

One `hs_<idx>.safetensors` per sample, holding `hidden_states` [seq, n_layers, hidden] in the
target dtype and `token_ids` [seq] int64: what speculators' FileTransfer / ArrowDataset load
(`<hidden_states_dir>/hs_<idx>.safetensors`); with [storage] hidden_dtype = "fp8", float8 with
a scale per token and layer instead (extract/hsformat.py, quantised on this thread). Each file is written through a temp file and a
rename (workers/runtime/atomic.py), so a file that exists is complete, and a resumed attempt may trust it;
the temp files a killed attempt leaves (eyas's and safetensors' own) are removed on resume.

The compute loop hands over whole batches and goes on; a thread slices and writes them.
The queue holds at most `max_pending` batches, so memory stays bounded when the disk is
slower than the model: the loop then waits, which is the point of the bound.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.workers.extract import hsformat
from eyas.workers.runtime import atomic

log = logging.getLogger("eyas.hswriter")

FILE_RE = re.compile(r"hs_(\d+)\.safetensors")
# atomic.py names its temp files ".<name>.<pid>.<n>.tmp".
TEMP_RE = re.compile(r"\.hs_(\d+)\.safetensors\..*\.tmp")


def file_name(idx: int) -> str:
    return f"hs_{idx}.safetensors"


def existing(directory: Path) -> set[int]:
    """Sample indices whose file is complete (present under its final name)."""
    try:
        names = [e.name for e in os.scandir(directory)]
    except FileNotFoundError:
        return set()
    return {int(m.group(1)) for n in names if (m := FILE_RE.fullmatch(n))}


def process_start_time() -> float:
    """When this process started (unix time)."""
    import psutil

    return psutil.Process().create_time()


def remove_temp_files(directory: Path, indices: set[int], written_before: float | None = None) -> int:
    """Remove the temp files a killed attempt left: eyas's own for `indices`, and safetensors'
    (atomic.is_library_temp) last written before `written_before` (default: when this process
    started); returns how many.

    Ranks share the directory, so each removes only what cannot be a live write: eyas's temp
    names carry the sample index, and a rank owns its indices. safetensors' names carry
    nothing, so its files go by age instead: one last written before this rank started was
    left by an earlier attempt (the daemon tears a group down before it starts the next),
    while a peer rank of this attempt writes only after it has started and loaded the target.
    """
    if written_before is None:
        written_before = process_start_time()
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0
    for entry in entries:
        m = TEMP_RE.fullmatch(entry.name)
        if m:
            doomed = int(m.group(1)) in indices
        elif atomic.is_library_temp(entry.name):
            try:
                doomed = entry.is_file(follow_symlinks=False) and entry.stat().st_mtime < written_before
            except FileNotFoundError:  # a peer removed it first
                doomed = False
        else:
            doomed = False
        if doomed:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            removed += 1
    return removed


@dataclass
class Item:
    idx: int  # the dataset row, which names the file
    row: int  # its row in the batch tensor
    length: int  # its real (unpadded) length
    token_ids: Any  # int64 tensor [length]


@dataclass
class Job:
    hidden: Any  # [batch, seq, n_layers, hidden] on the CPU, in the target dtype
    items: list[Item]  # only the samples still to write
    ready: Any = None  # a CUDA event to wait on before reading `hidden`, or None


_STOP = object()


class HiddenStatesWriter:
    """`put(job)` from the compute loop; `close()` waits for every file and re-raises a failure."""

    def __init__(self, directory: Path, max_pending: int = 2, hidden_dtype: str = "target", replace=os.replace):
        self.directory = Path(directory)
        self.hidden_dtype = hidden_dtype  # [storage] hidden_dtype: how each file stores its states
        # Moves a finished temp file to its name; streaming counts the file as it lands (extract/stream.py: Ledger).
        self.replace = replace
        self.directory.mkdir(parents=True, exist_ok=True)
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self.written = 0
        self.bytes = 0
        self._thread = threading.Thread(target=self._run, name="hs-writer", daemon=True)
        self._thread.start()

    def put(self, job: Job) -> None:
        self._raise_if_failed()
        while True:
            try:
                self._queue.put(job, timeout=0.5)
                return
            except queue.Full:
                # A writer that died would leave the queue full forever.
                self._raise_if_failed()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self._raise_if_failed()

    def abort(self) -> None:
        """Stop after the files already queued, without raising: the caller is failing anyway."""
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001
            log.error("%s", exc)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"writing hidden states to {self.directory} failed: {self._error!r}") from self._error

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            if self._error is not None:
                continue  # drain, so that put() never blocks on a dead writer
            try:
                if job.ready is not None:
                    job.ready.synchronize()
                for item in job.items:
                    # A contiguous view: rows of a [batch, seq, ...] tensor cut at `length`.
                    hidden = job.hidden[item.row, : item.length]
                    with atomic.atomic_path(self.directory / file_name(item.idx), self.replace) as tmp:
                        size = hsformat.write(tmp, hidden, item.token_ids, self.hidden_dtype)
                    self.written += 1
                    self.bytes += size
            except BaseException as exc:  # noqa: BLE001 - handed to the compute loop
                self._error = exc
