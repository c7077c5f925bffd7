"""TensorBoard event files from eyas's metric rows: the folder, the tag and the step of each sample, and the file itself, written with the stdlib alone.

Both writers use this module, so they agree sample for sample: the daemon's live one
(daemon/tensorboard.py, fed the rows it hands the store) and `eyas metrics RUN --tensorboard
DIR` (cli/tbexport.py, fed the store's rows).

- **Where**: `<dir>/run-<id>-<name>/`, one TensorBoard run per eyas run; each writer session adds
  its own `events.out.tfevents.*` file there, which TensorBoard reads together.
- **Tags**: `<stage>/<metric>` (`train/loss`, `train/tok_s` for the stage's rate), with
  `/rank<r>` for another rank's figures and for what the daemon measures per rank (CPU, RSS,
  GPU memory, tok/s): `train/gpu_mem_bytes/rank1`.
- **Steps**: a sample's step is its stage's progress when it was taken: the training step (the
  `step` the train stage writes with its figures) where the attempt writes one, else the
  sample count (`samples`) of the rank's progress record (selftest, extract, prepare); the
  daemon's own measures take the latest of these in their attempt (0 before any). The
  sample's time is the event's wall time, so TensorBoard's "relative" axis is the run's clock.
- **Events**: one per (time, step) of a rank, holding every metric of that record. The format
  is TFRecord (a length, the masked CRC-32C of it, the serialized `Event`, its masked CRC) of
  tensorboard's `Event` protobuf (wall_time = 1, step = 2, file_version = 3, summary = 5;
  `Summary.Value`: tag = 1, simple_value = 2), encoded here: tensorboard's own writer imports
  numpy, which the daemon must not load (pyproject's import contracts), and an event is three
  fields. tests/integration/daemon/test_tensorboard.py reads the files back with TensorBoard's
  EventAccumulator.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path

from eyas.state import queries

# What the daemon's sampler measures of every rank (daemon/sampler.py): tagged per rank always,
# so that rank 0's tok/s is not the stage's.
PER_RANK = frozenset({"cpu_percent", "rss_bytes", "gpu_mem_bytes", "tok_s"})
FILE_VERSION = "brain.Event:2"
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def run_folder(base: str | os.PathLike, run_id: int, name: str | None) -> Path:
    """The run's TensorBoard folder under `base`: `run-<id>-<name>`."""
    suffix = _SAFE.sub("-", name or "").strip("-")
    return Path(base) / (f"run-{run_id}-{suffix}" if suffix else f"run-{run_id}")


def tag(stage: str, name: str, rank: int | None) -> str:
    """`train/loss`; `train/gpu_mem_bytes/rank1`: see the module's docstring."""
    if rank is None or (rank == 0 and name not in PER_RANK):
        return f"{stage}/{name}"
    return f"{stage}/{name}/rank{rank}"


def stored_rows(db, run_id: int, stage: str | None = None, names: list[str] | None = None):
    """A run's stored samples (or one stage's, or some metrics') in the order in which the live
    writer met them: attempt after attempt, oldest first within one. Streamed: a cursor."""
    return queries.metric_rows(db, run_id, stage, names, order=queries.TIME_ORDER)


class StepClock:
    """The step of each sample of one run, fed its rows oldest first (in batches: the live
    writer's seconds, or the whole store at once)."""

    def __init__(self) -> None:
        self._step: dict[tuple, float] = {}  # (stage, attempt) -> the latest training step
        self._samples: dict[tuple, float] = {}  # (stage, attempt, rank) -> the latest sample count

    def events(self, rows: Iterable[dict]) -> list[tuple[float, int, list[tuple[str, float]]]]:
        """[(wall time, step, [(tag, value)])] of `rows` (dicts with time, stage, attempt, rank,
        name, value), one event per rank's record, oldest first."""
        records: dict[tuple, list[dict]] = {}
        for r in rows:
            records.setdefault((r["time"], r["stage"], r["attempt"], r["rank"]), []).append(r)
        out = []
        for key in sorted(records, key=lambda k: (k[0], k[1], k[2], k[3] is not None, k[3] or 0)):
            t, stage, attempt, rank = key
            figures = {r["name"]: r["value"] for r in records[key]}
            if "samples" in figures:
                self._samples[(stage, attempt, rank)] = figures["samples"]
            if "step" in figures:
                self._step[(stage, attempt)] = figures["step"]
            step = self._step.get((stage, attempt))
            if step is None:
                step = figures.get("samples", self._samples.get((stage, attempt, rank)))
            if step is None:
                counts = [v for (s, a, _), v in self._samples.items() if (s, a) == (stage, attempt)]
                step = max(counts, default=0)
            out.append((t, int(step), [(tag(stage, r["name"], rank), r["value"]) for r in records[key]]))
        return out


# -- the file --------------------------------------------------------------------------------


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), which TFRecord frames are checked with; the stdlib has only CRC-32."""
    crc = 0xFFFFFFFF
    table = _CRC_TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # a negative int64 is its two's complement, ten bytes
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): a string, bytes or a message."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def encode_event(wall_time: float, step: int = 0, *, file_version: str = "", scalars=()) -> bytes:
    """One serialized `Event`: its wall time and step, and either the file's version or a
    summary of scalars [(tag, value)]."""
    out = b"\x09" + struct.pack("<d", wall_time)
    if step:
        out += b"\x10" + _varint(step)
    if file_version:
        out += _field(3, file_version.encode())
    else:
        values = b"".join(_field(1, _field(1, t.encode()) + b"\x15" + struct.pack("<f", float(v))) for t, v in scalars)
        out += _field(5, values)
    return out


def frame(data: bytes) -> bytes:
    """A TFRecord: length, its masked CRC, the data, its masked CRC."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", _masked(crc32c(header))) + data + struct.pack("<I", _masked(crc32c(data)))


class EventFile:
    """An `events.out.tfevents.*` file of its own in `folder` (made if missing), opened with
    the file's version record; `mode` is set on the file when given (the daemon's umask is 077,
    and an output folder the user chose keeps theirs)."""

    _made = 0  # files this process made: two writers of one second get two names

    def __init__(self, folder: str | os.PathLike, *, now: float | None = None, mode: int | None = None):
        now = time.time() if now is None else now
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        EventFile._made += 1
        host = _SAFE.sub("-", socket.gethostname())
        self.path = folder / f"events.out.tfevents.{int(now):010d}.{host}.{os.getpid()}.{EventFile._made}"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
        if mode is not None:
            os.fchmod(fd, mode)
        self._f = os.fdopen(fd, "wb")
        self._f.write(frame(encode_event(now, file_version=FILE_VERSION)))
        self.events = 0

    def write(self, events: Iterable[tuple[float, int, list[tuple[str, float]]]]) -> None:
        """Append events [(wall time, step, [(tag, value)])] (StepClock.events)."""
        records = [frame(encode_event(t, step, scalars=values)) for t, step, values in events]
        self._f.write(b"".join(records))
        self.events += len(records)

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
