"""The streaming window between extract and train ([storage] mode = "streaming"): one stream of shards, a pure function of the run's config and data, that both sides walk in the same order.

The stream is the validation rows first (kept for the whole run: train validates after every
epoch), then each epoch's training rows in the order train consumes them: step by step, and
within a step rank by rank (workers/train/data.py: plan, a pure function of seed, world size and
epoch, the same plan an offline run trains on). Its mode is chosen once, by extract's rank 0, and
kept in stream/plan.json, so that a retry never changes it:
- "keep": the dataset fits the budget. The stream is the validation rows and epoch 0, written
  to hidden_states/ exactly as offline; nothing is freed and later epochs read from disk.
- "window": it does not. Every epoch's rows are (re)generated, the target staying loaded, into
  window/epoch-<e>/, and the trainer rank that trained on a shard deletes it after its step.

Back-pressure: an extract rank waits while the window's bytes plus its next batch's estimate
would pass the budget, unless that batch holds a shard of the step train needs now (going over
then beats a deadlock). Train says which step it needs in stream/trainer.json (rank 0), and
stream/done.json once it finished; extract in window mode lives until then, so that a failure of
either half finds the other alive (the daemon tears both down and restarts both,
daemon/settle.py). Resume: extract starts at train's latest checkpoint, where train resumes, and
writes only the shards that are missing; a shard train freed after its checkpoint is made again.

Files are written whole (tmp + rename, workers/extract/hswriter.py), so a shard that exists is
complete; the trainer polls for the next one it needs. The window's bytes are a running count
(Ledger: stream/window.json), changed under the window's lock as each shard lands or is freed,
and rebuilt from a listing once as extract starts; admission never lists the window.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.workers.runtime import atomic

log = logging.getLogger("eyas.stream")

STREAM_DIR = "stream"
PLAN = "plan.json"
TRAINER = "trainer.json"
DONE = "done.json"
LOCK = "window.lock"
LEDGER = "window.json"  # the window's bytes and files, a running count, and its peak (Ledger)
WINDOW_DIR = "window"
HS_DIR = "hidden_states"
POLL_S = 0.05
# Per file beyond the tensors: safetensors' JSON header, and the file system's rounding.
FILE_OVERHEAD = 4096


def token_bytes(n_ids: int, hidden: int, element_size: int, hidden_dtype: str = "target") -> int:
    """Bytes a shard spends per token: its hidden states ([storage] hidden_dtype "fp8": one byte
    an element and a scale per layer, counted as four bytes) and its int64 token id."""
    if hidden_dtype == "fp8":
        return n_ids * (hidden + 4) + 8
    return n_ids * hidden * element_size + 8


def shard_bytes(length: int, per_token: int) -> int:
    """A shard's size on disk, estimated (never below what it takes)."""
    return length * per_token + FILE_OVERHEAD


def budget_bytes(storage: dict, where: Path) -> int:
    """[storage] budget_gb, else budget_fraction of what is free where the shards go."""
    if storage.get("budget_gb"):
        return int(float(storage["budget_gb"]) * 1e9)
    st = os.statvfs(where)
    return int(st.f_bavail * st.f_frsize * float(storage.get("budget_fraction") or 0.5))


def epoch_orders(lengths: list[int], train_rows: list[int], batch_tokens: int, world: int, seed: int, epochs: int):
    """Per epoch: (the dataset rows in the order train consumes them, where each step ends in it)."""
    from eyas.workers.train import data as train_data

    train_lengths = [lengths[r] for r in train_rows]
    out = []
    for e in range(epochs):
        plans = [train_data.plan(train_lengths, batch_tokens, world, r, seed, e) for r in range(world)]
        order, ends = [], []
        for k in range(max((len(p) for p in plans), default=0)):
            for p in plans:
                if k < len(p):
                    order += [train_rows[i] for i in p[k]]
            ends.append(len(order))
        out.append((order, ends))
    return out


@dataclass
class Stream:
    """The stream both sides walk (see the module docstring)."""

    mode: str  # "keep" | "window"
    budget: int
    dataset_bytes: int
    val_rows: list[int]
    orders: list[tuple[list[int], list[int]]]  # per epoch: rows in consumption order, step ends
    extract_dir: Path

    @property
    def keep(self) -> bool:
        return self.mode == "keep"

    def dir_for(self, epoch: int | None) -> Path:
        """Where the shards of `epoch` live (None: the validation rows)."""
        if epoch is None or self.keep:
            return self.extract_dir / HS_DIR
        return self.extract_dir / WINDOW_DIR / f"epoch-{epoch}"

    def items(self, start: tuple[int, int] = (0, 0)) -> list[tuple[int | None, int]]:
        """(epoch or None, row) from the validation rows, then from step `start` = (epoch, step)
        on; keep mode has only epoch 0 (later epochs read its files)."""
        out: list[tuple[int | None, int]] = [(None, r) for r in self.val_rows]
        epochs = 1 if self.keep else len(self.orders)
        e0, k0 = (0, 0) if self.keep else start
        for e in range(e0, epochs):
            order, ends = self.orders[e]
            first = ends[k0 - 1] if e == e0 and k0 > 0 else 0
            out += [(e, r) for r in order[first:]]
        return out

    def index(self, at: tuple[int, int], start: tuple[int, int]) -> int:
        """Where step `at` = (epoch, step) begins in `items(start)` (clamped to its ends); a step
        past an epoch's last is the next epoch's first."""
        total = len(self.items(start))
        e, k = at
        if self.keep:
            if e > 0:
                return total
            ends = self.orders[0][1]
            return min(total, len(self.val_rows) + (ends[k - 1] if 0 < k <= len(ends) else (0 if k <= 0 else ends[-1])))
        e0, k0 = start
        if (e, k) <= (e0, k0):
            return len(self.val_rows)
        n = len(self.val_rows)
        for i in range(e0, min(e, len(self.orders)) + (0 if e >= len(self.orders) else 1)):
            order, ends = self.orders[i]
            first = ends[k0 - 1] if i == e0 and k0 > 0 else 0
            upto = len(order) if i < e else (ends[k - 1] if 0 < k <= len(ends) else (0 if k <= 0 else len(order)))
            n += max(0, upto - first)
        return min(n, total)

    def needed_through(self, need: tuple[int, int] | None, start: tuple[int, int]) -> int:
        """How many items of `items(start)` the trainer needs now: through the end of its step."""
        e, k = need if need is not None else start
        return self.index((e, k + 1), start)

    def scan_bytes(self) -> tuple[int, int]:
        """(bytes, files) of every finished shard now on disk, validation rows included, found by
        listing the directories: what the Ledger starts from, never what a batch's admission
        reads. Temp files are a batch in flight, which admission counts at its estimate."""
        from eyas.workers.extract.hswriter import FILE_RE

        total = files = 0
        dirs = [self.extract_dir / HS_DIR]
        window = self.extract_dir / WINDOW_DIR
        if window.is_dir():
            dirs += [d for d in window.iterdir() if d.is_dir()]
        for d in dirs:
            try:
                entries = list(os.scandir(d))
            except FileNotFoundError:
                continue
            for entry in entries:
                if not FILE_RE.fullmatch(entry.name):
                    continue
                try:
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat().st_size
                        files += 1
                except FileNotFoundError:  # freed meanwhile
                    continue
        return total, files


@contextlib.contextmanager
def locked(extract_dir: Path):
    """The window's one lock, across every extract and train rank (stream/window.lock): a batch's
    admission, a shard's arrival under its final name and its freeing each hold it."""
    import fcntl

    stream_dir = extract_dir / STREAM_DIR
    stream_dir.mkdir(parents=True, exist_ok=True)
    with open(stream_dir / LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Ledger:
    """The window's bytes on disk as a running count (stream/window.json: bytes and files), kept
    exact under the window's lock: a shard is renamed to its final name and added, or removed
    and subtracted, in one holding of the lock, by whichever rank does it.

    Why not list the directories: admission checks the window before every batch, on every
    extract rank, under the lock that every other rank and the trainer wait on; a window of
    thousands of shards (keep mode holds the whole dataset) made that a scan of thousands of
    files per batch. The shard itself is the record of its size (its inode), so the count needs
    no per-shard table: the one who adds or frees it stats it under the lock.

    A process killed between the rename (or the unlink) and the count's write leaves the count
    off by that shard, so extract's rank 0 rebuilds it from a scan when it starts, before any
    rank admits a batch (a streaming run's halves always restart together, daemon/settle.py).
    A rebuild under the lock is exact whatever else runs: it replaces the count, it does not
    add to it. The file is rewritten whole (temp + rename) but not fsynced: after a power loss
    the rebuild makes it right again.

    The window's peak, the largest the count has been over every attempt of the run, is kept
    beside it, and is the one figure of it that extract's summary and `eyas show` report. The
    window is at its largest just after a shard lands, and only this count sees every landing:
    extract's own look before each admission misses what lands after it (the last batches
    above all), and the daemon's samples of the progress lines miss what happens between them.
    Shards in flight (temp files) are not in it, as they are not in the count.
    """

    def __init__(self, extract_dir: Path):
        self.extract_dir = Path(extract_dir)
        self.path = self.extract_dir / STREAM_DIR / LEDGER

    def figures(self) -> tuple[int, int, int]:
        """(bytes, files, peak bytes) as last written; safe without the lock, the file is replaced whole."""
        try:
            d = json.loads(self.path.read_text())
            total = int(d["bytes"])
            return total, int(d["files"]), max(total, int(d.get("peak", 0)))
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return 0, 0, 0

    def read(self) -> tuple[int, int]:
        """(bytes, files) as last written."""
        return self.figures()[:2]

    def total(self) -> int:
        return self.figures()[0]

    def peak(self) -> int:
        """The most bytes the window has held at once, over every attempt of the run."""
        return self.figures()[2]

    def _write(self, total: int, files: int, peak: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"bytes": total, "files": files, "peak": max(peak, total)}))
        os.replace(tmp, self.path)

    def rebuild(self, st: Stream) -> int:
        """Count what is on disk now (once, as an attempt starts); returns the bytes. The peak
        of the attempts before stays (or is what is on disk, if that is more)."""
        with locked(self.extract_dir):
            total, files = st.scan_bytes()
            self._write(total, files, self.peak())
        return total

    def replace(self, tmp: Path, final: Path) -> None:
        """Move a written shard to its final name and count it (atomic.atomic_path's `replace`)."""
        with locked(self.extract_dir):
            total, files, peak = self.figures()
            size = os.stat(tmp).st_size
            try:  # written again over an older copy (never in a healthy run): that copy goes
                total, files = total - os.stat(final).st_size, files - 1
            except FileNotFoundError:
                pass
            os.replace(tmp, final)
            self._write(total + size, files + 1, peak)

    def free(self, paths) -> int:
        """Delete these shards (those that exist) and uncount them; returns how many."""
        freed = 0
        with locked(self.extract_dir):
            total, files, peak = self.figures()
            for path in paths:
                try:
                    size = os.stat(path).st_size
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                total, files, freed = total - size, files - 1, freed + 1
            if freed:
                self._write(total, files, peak)
        return freed


def sibling_ranks(cfg: dict, stage: str) -> int:
    """Ranks of the other half of a streaming run, sharing this host's cores; 0 offline."""
    from eyas.state import specs
    from eyas.state.runconfig import RunConfig, stage_world_size

    if not specs.streaming(cfg):
        return 0
    return stage_world_size(RunConfig.from_dict(cfg), specs.sibling(stage))


def plan_path(extract_dir: Path) -> Path:
    return extract_dir / STREAM_DIR / PLAN


def write_plan(extract_dir: Path, fields: dict[str, Any]) -> dict[str, Any]:
    """Record the stream's mode once (the first writer wins); returns what is recorded."""
    path = plan_path(extract_dir)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_json(path, fields)
    return json.loads(path.read_text())


def wait_for(path: Path, progress, what: str, timeout: float | None = None, waits: str | None = None) -> float:
    """Poll for `path`, with heartbeats that say what the rank waits for (`waits`: the streaming
    sibling that writes it, whose liveness then stands for this rank's; None: a peer of the same
    group); returns the seconds waited (0.0 when it was there)."""
    if path.exists():
        return 0.0
    t0 = time.monotonic()
    with progress.beating(what, kind="wait", waits=waits):
        while not path.exists():
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{path} did not appear within {timeout:.0f} s ({what})")
            time.sleep(POLL_S)
    return time.monotonic() - t0


def load(extract_dir: Path, prepare_dir: Path, cfg: dict, lengths: list[int]) -> Stream:
    """The stream of a run whose plan.json exists, computed from its config and data."""
    from eyas.state.runconfig import RunConfig, stage_world_size
    from eyas.workers.train import data as train_data

    plan = json.loads(plan_path(extract_dir).read_text())
    rc = RunConfig.from_dict(cfg)
    train_rows, val_rows = train_data.read_splits(prepare_dir, len(lengths))
    orders = epoch_orders(
        lengths, train_rows, rc.train.batch_tokens, stage_world_size(rc, "train"), rc.train.seed, rc.train.epochs
    )
    return Stream(plan["mode"], int(plan["budget"]), int(plan["dataset_bytes"]), val_rows, orders, extract_dir)


def read_need(extract_dir: Path) -> tuple[int, int] | None:
    """The (epoch, step) train needs now, or None before it said."""
    try:
        d = json.loads((extract_dir / STREAM_DIR / TRAINER).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return int(d["epoch"]), int(d["step"])


def publish_need(extract_dir: Path, epoch: int, step: int) -> None:
    atomic.write_json(extract_dir / STREAM_DIR / TRAINER, {"epoch": epoch, "step": step})


def train_done(extract_dir: Path) -> bool:
    return (extract_dir / STREAM_DIR / DONE).exists()


def mark_done(extract_dir: Path) -> None:
    atomic.write_json(extract_dir / STREAM_DIR / DONE, {"time": time.time()})


def resume_point(train_dir: Path) -> tuple[int, int]:
    """(epoch, step) where train resumes: its latest checkpoint's, else the start."""
    from eyas.workers.train import checkpoint

    ckpt = checkpoint.latest(train_dir / "checkpoints")
    if ckpt is None:
        return 0, 0
    return int(ckpt.state["next_epoch"]), int(ckpt.state["next_step"])
