"""The `prepare` stage: chats (or pre-tokenized rows) in, speculators' training rows out.

Each row is read and checked (workers/data/reader.py), rendered with the target's chat
template into input_ids and an assistant-only loss mask (workers/data/chat.py), truncated to
data.max_length, and dropped when nothing in it is trainable. A malformed row is skipped and
counted by reason, and so is a row too long to be worth rendering (over
data/reader.py: row_byte_limit(max_length) bytes), before it is even parsed, which keeps the
stage's memory bounded whatever the data holds; the stage fails only on problems that no row
can fix (no data, a template that re-renders history, a tokenizer that does not fit the model).

Outputs, in <output_dir>/prepare/:
- dataset/          a datasets arrow directory (save_to_disk), one row per kept input row, in
                    input order, with speculators prepare-data's columns and types: input_ids
                    list<int32>, loss_mask list<int64>, seq_len int64, torch format;
- token_freq.npy    int64 [target vocab]: how often each id sits at a loss-masked position.
                    speculators pickles a {id: count} dict (token_freq.pt, torch.save); eyas
                    never writes pickles, and the dense array holds the same counts;
- splits.json       {"validation": [row indices], ...}: the held-out rows, chosen from
                    data.validation_fraction and train.seed (extract covers every row);
- summary.json      written last, removed first: present means the files beside it are
                    complete and belong together.
A retry redoes the work in a temp folder and swaps the results in only at the end, so a
crash mid-way leaves an earlier complete output untouched.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from eyas.state import contract
from eyas.state.inputtables import DataConfig
from eyas.state.runconfig import RunConfig
from eyas.workers.data.chat import MaskedRenderer, RenderError, TemplateMismatch, load_tokenizer
from eyas.workers.data.reader import (
    SKIP_REASONS,
    Chat,
    RawRow,
    RowError,
    count_rows,
    data_files,
    normalize,
    read_rows,
    row_byte_limit,
)
from eyas.workers.data.target_vocab import target_vocab_size
from eyas.workers.runtime import atomic, phases

log = logging.getLogger("eyas.prepare")

TMP_PREFIX = ".prepare-tmp-"
EXAMPLES_PER_REASON = 3  # skipped rows logged in full per reason; the rest are only counted
BATCH_ROWS = 1024  # rows per arrow record batch


def main(ctx) -> None:
    cfg = RunConfig.from_dict(ctx.config)
    if cfg.target is None or cfg.data is None:
        raise ValueError("prepare needs [target] and [data] in the run's config; add both tables")
    stage_dir = ctx.stage_dir
    for old in stage_dir.glob(TMP_PREFIX + "*"):
        # Left by a crashed attempt; only prepare (one rank) writes here.
        shutil.rmtree(old, ignore_errors=True)
    tmp = stage_dir / f"{TMP_PREFIX}{ctx.attempt}-{os.getpid()}"
    tmp.mkdir()
    try:
        summary, freq, splits = build(cfg, tmp / "dataset", ctx.progress)
        summary["outputs"] = [str(stage_dir / name) for name in ("dataset", "token_freq.npy", "splits.json")]
        # fsyncs every file: minutes on a big one
        with ctx.progress.beating(
            "publish dataset", kind="data", budget=phases.data_budget(tmp), evidence=phases.io_evidence
        ):
            publish(stage_dir, tmp, freq, splits, summary)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    atomic.write_json(ctx.attempt_dir / contract.SUMMARY, summary)


class _Rows:
    """The kept rows as arrow record batches, plus the token frequencies over masked positions."""

    def __init__(self, vocab_size: int):
        import pyarrow as pa

        self.pa = pa
        self.freq = np.zeros(vocab_size, dtype=np.int64)
        self.batches: list = []
        self._ids: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self.rows = self.tokens = self.trainable = 0

    def add(self, ids: list[int], mask: list[int]) -> None:
        self._ids.append(np.asarray(ids, dtype=np.int64))
        self._masks.append(np.asarray(mask, dtype=np.int64))
        self.rows += 1
        self.tokens += len(ids)
        self.trainable += int(self._masks[-1].sum())
        if len(self._ids) >= BATCH_ROWS:
            self.flush()

    def flush(self) -> None:
        if not self._ids:
            return
        pa = self.pa
        ids, masks = np.concatenate(self._ids), np.concatenate(self._masks)
        # One bincount per batch, not per row: a row's would allocate a whole vocab each time.
        self.freq += np.bincount(ids[masks == 1], minlength=len(self.freq))
        lengths = np.fromiter((len(a) for a in self._ids), dtype=np.int64, count=len(self._ids))
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        self.batches.append(
            pa.record_batch(
                {
                    "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids.astype(np.int32))),
                    "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(masks)),
                    "seq_len": pa.array(lengths),
                }
            )
        )
        self._ids, self._masks = [], []

    def save(self, path: Path) -> None:
        """save_to_disk with speculators' column types and torch format."""
        import datasets
        from datasets.table import InMemoryTable

        self.flush()
        datasets.disable_progress_bars()  # a bar per save would flood the rank log
        features = datasets.Features(
            {
                # datasets stores input_ids as int32 (its optimized int type for that name), which
                # is what speculators' prepare-data ends up writing; the torch format reads int64.
                "input_ids": datasets.List(datasets.Value("int32")),
                "loss_mask": datasets.List(datasets.Value("int64")),
                "seq_len": datasets.Value("int64"),
            }
        )
        table = self.pa.Table.from_batches(self.batches, schema=features.arrow_schema)
        ds = datasets.Dataset(InMemoryTable(table), info=datasets.DatasetInfo(features=features))
        ds.set_format(type="torch")
        ds.save_to_disk(str(path))


class _Skips:
    """Skipped rows by reason; the first few of each reason go to the log in full."""

    def __init__(self):
        self.counts: Counter[str] = Counter()

    def add(self, where: str, err: RowError) -> None:
        self.counts[err.reason] += 1
        n = self.counts[err.reason]
        if n <= EXAMPLES_PER_REASON:
            log.warning("skipped %s (%s): %s", where, err.reason, err.detail)
            if n == EXAMPLES_PER_REASON:
                log.warning("any further %s rows are counted, not logged", err.reason)

    def as_dict(self) -> dict[str, int]:
        return {r: self.counts[r] for r in SKIP_REASONS if self.counts[r]}


def _beating(progress, phase: str, path):
    """Heartbeats through `phase`, a pass over the data at `path`, when there is a progress file
    (tests call build() without one)."""
    if progress is None:
        return contextlib.nullcontext()
    return progress.beating(phase, kind="data", budget=phases.data_budget(path), evidence=phases.io_evidence)


def build(cfg: RunConfig, dataset_dir: Path, progress=None) -> tuple[dict[str, Any], np.ndarray, dict[str, Any]]:
    """Read, render, mask and count every row; save the dataset to `dataset_dir`; return the
    summary, the token frequencies and the splits."""
    data, target = cfg.data, cfg.target
    vocab = target_vocab_size(target.path)
    files = data_files(data.path)
    # Rows over this many bytes are skipped unread (too_long): see data/reader.py: row_byte_limit.
    row_bytes = row_byte_limit(data.max_length)
    with _beating(progress, "count rows", data.path):  # a pass over the whole file: silent on a big one
        total = count_rows(files, row_bytes)
    log.info(
        "prepare: %d rows in %d file(s) under %s; max_length %d (rows over %d bytes skipped), format %s, limit %s",
        total,
        len(files),
        data.path,
        data.max_length,
        row_bytes,
        data.format,
        data.limit or "none",
    )
    if progress:
        progress.update(samples=0, tokens=0, samples_total=total, force=True)

    @functools.cache
    def renderer() -> MaskedRenderer:
        # Loaded at the first chat row: pre-tokenized data needs no tokenizer at all.
        r = MaskedRenderer(load_tokenizer(target.path, target.trust_remote_code), where=target.path)
        log.info(
            "assistant mask: %s",
            "the template's {% generation %} blocks"
            if r.method == "generation"
            else "rendered prefixes (no {% generation %} in the template, or a slow tokenizer)",
        )
        return r

    rows, skips, methods = _Rows(vocab), _Skips(), Counter()
    rows_in = truncated = 0
    for raw in read_rows(files, row_bytes):
        if data.limit and rows.rows >= data.limit:
            log.info("stopped at data.limit = %d rows", data.limit)
            break
        rows_in += 1
        try:
            ids, mask, method, cut = encode_row(raw, data, vocab, renderer, target.path)
        except RowError as err:
            skips.add(raw.where, err)
        else:
            truncated += cut
            methods[method] += 1
            rows.add(ids, mask)
        if progress:
            progress.update(samples=rows_in, tokens=rows.tokens)

    if rows.rows == 0:
        raise ValueError(
            f"data.path: no usable rows in {data.path} ({rows_in} read, skipped: "
            f"{skips.as_dict() or 'none'}); fix the data or its format (see the log for examples)"
        )
    with _beating(progress, "save dataset", data.path):
        rows.save(dataset_dir)
    validation = validation_rows(rows.rows, data.validation_fraction, cfg.train.seed)
    splits = {
        "rows": rows.rows,
        "validation_fraction": data.validation_fraction,
        "seed": cfg.train.seed,
        "validation": validation,
    }
    summary = {
        "rows_in": rows_in,
        "rows_out": rows.rows,
        "skipped": skips.as_dict(),
        "skipped_total": sum(skips.counts.values()),
        "truncated": truncated,
        "tokens": rows.tokens,
        "trainable_tokens": rows.trainable,
        "validation_rows": len(validation),
        "mask_method": dict(methods),
        "max_length": data.max_length,
        "row_byte_limit": row_bytes,
        "target_vocab_size": vocab,
        "data_path": data.path,
        "data_files": len(files),
    }
    if progress:
        progress.update(samples=rows_in, samples_total=rows_in, tokens=rows.tokens, force=True)
    skipped = ", ".join(f"{r} {n}" for r, n in summary["skipped"].items()) or "none"
    log.info(
        "prepare: %d rows in, %d out; skipped %d (%s); truncated %d; %d tokens, %d trainable; %d validation rows",
        rows_in,
        rows.rows,
        summary["skipped_total"],
        skipped,
        truncated,
        rows.tokens,
        rows.trainable,
        len(validation),
    )
    return summary, rows.freq, splits


def encode_row(
    raw: RawRow, data: DataConfig, vocab: int, renderer, target_path: str
) -> tuple[list[int], list[int], str, bool]:
    """One row as (input_ids, loss_mask, mask method, truncated?); RowError when it is skipped."""
    if raw.error is not None:
        raise raw.error
    item = normalize(raw.value, data.format, vocab)
    if isinstance(item, Chat):
        ids, mask = _render(renderer(), item, raw.where, vocab, target_path)
        method = renderer().method
    else:
        ids, mask, method = item.input_ids, item.loss_mask, "pretokenized"
    cut = len(ids) > data.max_length
    ids, mask = ids[: data.max_length], mask[: data.max_length]
    if not any(mask):
        where = f" within max_length {data.max_length}" if cut else ""
        raise RowError("no_trainable_tokens", f"no assistant token{where}")
    return ids, mask, method, cut


def _render(
    renderer: MaskedRenderer, chat: Chat, where: str, vocab: int, target_path: str
) -> tuple[list[int], list[int]]:
    try:
        ids, mask = renderer.render(chat.messages)
    except RenderError as exc:
        raise RowError("template_error", str(exc)) from None
    except TemplateMismatch as exc:
        # The template, not the row, is at fault: every later row would hit it too.
        raise TemplateMismatch(exc.turn, f"{where}: {exc}") from None
    top = max(ids, default=0)
    if top >= vocab:
        raise ValueError(
            f"{target_path}: the tokenizer produced token id {top}, but config.json's vocab_size is "
            f"{vocab}; the tokenizer and the model do not match, point target.path at a consistent model"
        )
    return ids, mask


def validation_rows(n: int, fraction: float, seed: int) -> list[int]:
    """The held-out row indices: round(n * fraction) of them (at least 1 when fraction > 0,
    never all n), the rows whose hash of (seed, index) is smallest. A hash rather than a PRNG:
    the choice stays the same across Python and numpy versions."""
    if fraction <= 0 or n < 2:
        return []
    k = min(n - 1, max(1, round(n * fraction)))
    order = sorted(range(n), key=lambda i: hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest())
    return sorted(order[:k])


def publish(stage_dir: Path, tmp: Path, freq: np.ndarray, splits: dict[str, Any], summary: dict[str, Any]) -> None:
    """Move the dataset built in `tmp` into `stage_dir`, write the other outputs; summary.json last."""
    marker = stage_dir / "summary.json"
    # From here until the marker is back, the folder reads as incomplete.
    marker.unlink(missing_ok=True)
    for root, _, names in os.walk(tmp / "dataset"):
        for name in names:  # save_to_disk does not fsync; the rename below must not outrun the data
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    dataset = stage_dir / "dataset"
    if dataset.exists():
        os.rename(dataset, tmp / "replaced-dataset")
    os.rename(tmp / "dataset", dataset)
    with atomic.atomic_path(stage_dir / "token_freq.npy") as dest, open(dest, "wb") as f:
        np.save(f, freq)
    atomic.write_json(stage_dir / "splits.json", splits)
    atomic.write_json(marker, summary)
