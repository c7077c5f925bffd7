"""Extract's side of the streaming window (workers/extract/stream.py): one hf rank writes its share of the stream's shards in train's order, waiting while the window is full.

Rank 0 chooses the stream's mode once (keep the whole dataset when it fits the budget, else a
window whose epochs are regenerated) and writes data_config.json before any shard, so that
train can start at once. The stream is cut into batches (validation rows, then each epoch's
rows, never a batch across two of them), dealt round-robin to the ranks. A retried attempt
starts where train resumes (its latest checkpoint) and writes only the shards that are missing.
In window mode every rank then lives until train says it is done: a shard train may still need
(after a restart of both halves) can only be made by a live extractor.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

from eyas.workers.extract import hswriter, stream
from eyas.workers.extract.output import DATA_CONFIG, data_config
from eyas.workers.runtime import atomic

log = logging.getLogger("eyas.extract")


def choose_mode(ctx, settings, lengths, per_token: int) -> dict:
    """Rank 0: keep or window, from the dataset's estimated size and the budget (stream/plan.json)."""
    dataset_bytes = sum(stream.shard_bytes(n, per_token) for n in lengths)
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    budget = stream.budget_bytes((ctx.config or {}).get("storage") or {}, settings.out_dir)
    mode = "keep" if dataset_bytes <= budget else "window"
    plan = stream.write_plan(
        settings.out_dir, {"mode": mode, "budget": budget, "dataset_bytes": dataset_bytes, "samples": len(lengths)}
    )
    if plan["mode"] == "keep":
        log.info(
            "streaming: the whole dataset (%.3f GB) fits the budget (%.3f GB): it is kept on disk, and later "
            "epochs read it as offline training does",
            plan["dataset_bytes"] / 1e9,
            plan["budget"] / 1e9,
        )
    else:
        log.info(
            "streaming: the dataset (%.3f GB) does not fit the budget (%.3f GB): train frees each shard after "
            "its step, and every epoch's shards are made again while the target stays loaded",
            plan["dataset_bytes"] / 1e9,
            plan["budget"] / 1e9,
        )
    return plan


def batches(st: stream.Stream, start: tuple[int, int], batch_size: int) -> list[tuple[int, int | None, list[int]]]:
    """The stream from `start` cut into batches: (position of the first item, epoch, rows)."""
    items = st.items(start)
    out: list[tuple[int, int | None, list[int]]] = []
    k = 0
    while k < len(items):
        epoch = items[k][0]
        end = k
        while end < len(items) and end - k < batch_size and items[end][0] == epoch:
            end += 1
        out.append((k, epoch, [r for _, r in items[k:end]]))
        k = end
    return out


class Producer:
    """One extract rank's walk of the stream: admit a batch into the window, compute it, hand it
    to the writer.

    Admission is strict, under one lock for every rank (stream/window.lock): a batch at position
    p goes when the files on disk (the Ledger's count, stream.py), every rank's batches in
    flight and the shards still missing before p (from the start of the step train needs now)
    leave room for it. Shards before p are needed first, so room is kept for them: the earliest
    missing batch always finds room once train frees its last step, and a later batch can never
    take it. Only a budget smaller than one step can still block that batch: after GRACE_S it
    goes over, with a warning, rather than deadlock.
    """

    GRACE_S = 10.0

    def __init__(self, ctx, settings, st: stream.Stream, start: tuple[int, int], lengths, per_token: int):
        self.ctx, self.settings, self.st, self.start = ctx, settings, st, start
        self.lengths = lengths
        self.per_token = per_token
        self.items = st.items(start)
        self.writer: hswriter.HiddenStatesWriter | None = None
        self.written = 0  # files of closed writers
        self.in_flight: list[tuple[int, int, int, int]] = []  # (pos, end, bytes, files written when done)
        self.waits = 0  # times this rank waited for room in the window
        self.wait_s = 0.0
        self.over = 0  # batches let over the budget (a budget below one step)
        self.started = hswriter.process_start_time()
        self.stream_dir = st.extract_dir / stream.STREAM_DIR
        self.stream_dir.mkdir(parents=True, exist_ok=True)
        self.ledger = stream.Ledger(st.extract_dir)  # the window's bytes, counted, never scanned
        self.mine = self.stream_dir / f"inflight-{ctx.rank}.json"
        self._publish()

    def est(self, rows) -> int:
        return sum(stream.shard_bytes(self.lengths[r], self.per_token) for r in rows)

    def _need(self) -> tuple[int, int] | None:
        path = self.stream_dir / stream.TRAINER
        try:
            # A need written before this attempt began is the last attempt's: train resumes
            # at its checkpoint (self.start) and will say so.
            if path.stat().st_mtime < self.started:
                return None
        except FileNotFoundError:
            return None
        return stream.read_need(self.st.extract_dir)

    def _done_files(self) -> int:
        return self.written + (self.writer.written if self.writer is not None else 0)

    def _done_when(self, files: int) -> int:
        """The count _done_files() reaches once a batch of `files` files admitted now has landed."""
        return self._done_files() + files

    def _publish(self) -> None:
        done = self._done_files()
        self.in_flight = [b for b in self.in_flight if b[3] > done]
        atomic.write_json(self.mine, [[p, e, n] for p, e, n, _ in self.in_flight])

    def _flights(self) -> list[tuple[int, int, int]]:
        out = []
        for path in self.stream_dir.glob("inflight-*.json"):
            try:
                out += [tuple(b) for b in json.loads(path.read_text())]
            except (FileNotFoundError, ValueError):
                continue
        return out

    def _fits(self, pos: int, end: int, est: int) -> bool:
        """Under the lock: whether the batch [pos, end) may go now; if so it is in flight."""
        self._publish()
        flights = self._flights()
        busy = set()
        for p, e, _ in flights:
            busy.update(range(p, e))
        # Before p: the validation shards (kept all run) and the stream from the step train needs now.
        lo = self.st.index(self._need() or self.start, self.start)
        before = [*range(min(len(self.st.val_rows), pos)), *range(lo, pos)]
        earlier = sum(
            self.est([self.items[i][1]])
            for i in before
            if i not in busy and not (self.st.dir_for(self.items[i][0]) / hswriter.file_name(self.items[i][1])).exists()
        )
        disk = self.ledger.total()  # we hold the lock: exact, and no listing of the window
        used = disk + sum(n for _, _, n in flights)
        return used + earlier + est <= self.st.budget

    def admit(self, pos: int, end: int, est: int, files: int) -> None:
        """Wait until the batch [pos, end), `files` files of `est` bytes, fits the window; then
        it is in flight until its files are written."""
        with contextlib.ExitStack() as beating:
            self._admit(pos, end, est, files, beating)

    def _admit(self, pos: int, end: int, est: int, files: int, beating) -> None:
        t0 = None
        while True:
            with stream.locked(self.st.extract_dir):
                fits = self._fits(pos, end, est)
                late = t0 is not None and time.monotonic() - t0 > self.GRACE_S
                if not fits and late and pos < self.st.needed_through(self._need(), self.start):
                    self.over += 1
                    log.warning(
                        "the window's budget (%.3f GB) is too small for the step train needs now: going over it",
                        self.st.budget / 1e9,
                    )
                    fits = True
                if fits:
                    self.in_flight.append((pos, end, est, self._done_when(files)))
                    self._publish()
                    break
            if t0 is None:
                t0 = time.monotonic()
                self.waits += 1
                beating.enter_context(
                    self.ctx.progress.beating("waiting for room in the window", kind="wait", waits="train")
                )
            time.sleep(stream.POLL_S)
        if t0 is not None:
            self.wait_s += time.monotonic() - t0

    def put(self, directory: Path, job) -> None:
        if self.writer is not None and self.writer.directory != directory:
            self.writer.close()  # one directory at a time: the files land in stream order
            self.written += self.writer.written
            self.writer = None
        if self.writer is None:
            self.writer = hswriter.HiddenStatesWriter(
                directory,
                hidden_dtype=getattr(self.settings, "hidden_dtype", "target"),
                replace=self.ledger.replace,  # each shard lands and is counted under the window's lock
            )
        self.writer.put(job)

    def metrics(self) -> dict:
        total, _, peak = self.ledger.figures()
        return {
            "window_bytes": total,
            # The ledger's own peak (stream.Ledger says why), never the largest of these samples:
            # `eyas show` takes the largest of this metric, the summary the last (peak()).
            "window_peak_bytes": peak,
            "window_budget": self.st.budget,
            "extract_waits": self.waits,
            "extract_wait_s": round(self.wait_s, 3),
        }

    def close(self) -> None:
        """The walk is over and every file it made has landed: nothing of this rank is in
        flight, so its in-flight record goes. A failed walk (abort) leaves it, as a kill would;
        the retry's rank rewrites it as it starts, and clear_leftovers removes those of ranks
        the retry does not have."""
        if self.writer is not None:
            self.writer.close()
            self.written += self.writer.written
            self.writer = None
        self.in_flight = []
        self.mine.unlink(missing_ok=True)

    def peak(self) -> int:
        """The window's peak for the stage's summary, once every rank's files have landed,
        published as the progress metric too: `eyas show` and the summary say the same number."""
        peak = self.ledger.peak()
        self.ctx.progress.update(window_peak_bytes=peak, force=True)
        return peak

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


def run(ctx, settings, target, layer_ids, dataset, lengths, st: stream.Stream, start, stats, per_token: int):
    """Walk this rank's share of the stream; `stats` (extract/plan.py: Stats) counts it."""
    import torch

    from eyas.workers.extract import hf
    from eyas.workers.extract.plan import check_row
    from eyas.workers.models.capture import LayerCapture

    rows = dataset.with_format(None)
    hidden = hf.hidden_size(target)
    mine = batches(st, start, settings.batch_size)[ctx.rank :: ctx.world_size]
    clear_leftovers(st, start, mine, ctx.world_size, first=ctx.rank == 0)
    prod = Producer(ctx, settings, st, start, lengths, per_token)
    pad_id = hf._pad_id(target.model)
    torch_dtype = getattr(torch, settings.dtype)
    capture = LayerCapture(target.decoder, layer_ids)
    t0 = time.monotonic()
    try:
        with torch.inference_mode(), capture:
            for directory, batch, missing in walk(ctx, prod, st, mine, lengths, stats):
                token_ids = [rows[i]["input_ids"] for i in batch]
                for i, ids in zip(batch, token_ids):
                    check_row(i, ids, lengths)
                buf = hf._buffer(token_ids, len(layer_ids), hidden, torch_dtype, settings.device)
                hf._forward(target.decoder, capture, token_ids, pad_id, settings.device, buf)
                prod.put(directory, hf.job(buf, batch, token_ids, set(missing), settings.device))
    except BaseException:
        prod.abort()
        raise
    prod.close()
    stats.written = prod.written
    finished(ctx, prod, stats, time.monotonic() - t0, "streaming rank done")
    if not st.keep:
        # Alive until train is done: after a failure of either half both restart, and the
        # extractor is what makes again the shards train freed after its last checkpoint.
        with ctx.progress.beating("waiting for train to finish", kind="wait", waits="train"):
            while not stream.train_done(st.extract_dir):
                time.sleep(0.2)
    return prod


def clear_leftovers(st: stream.Stream, start: tuple[int, int], mine: list, world_size: int, first: bool) -> None:
    """What a killed attempt left that would mislead this one: the temp files of this rank's
    share (they would count against the window for ever) and, on the `first` rank, what train
    used before its resume point and the in-flight records of an attempt with more ranks."""
    by_dir: dict[Path, set[int]] = {}
    for _, epoch, batch in mine:
        by_dir.setdefault(st.dir_for(epoch), set()).update(batch)
    for directory, indices in by_dir.items():
        hswriter.remove_temp_files(directory, indices)
    if first:
        prune_before(st, start)
        for path in (st.extract_dir / stream.STREAM_DIR).glob("inflight-*.json"):
            if int(path.stem.split("-")[1]) >= world_size:
                path.unlink(missing_ok=True)


def walk(ctx, prod: Producer, st: stream.Stream, mine: list, lengths, stats):
    """This rank's batches that need making, as (directory, batch, missing rows), each admitted
    into the window before it is yielded and counted in `stats` and the progress once the caller
    has made it. A batch whose shards all exist (a resumed attempt's) is counted and skipped."""
    # Every item of this rank's share counts, present or not: what is present was done before.
    total = [r for _, _, b in mine for r in b]
    ctx.progress.update(
        samples=0, tokens=0, samples_total=len(total), tokens_total=sum(lengths[r] for r in total), force=True
    )
    for b, (pos, epoch, batch) in enumerate(mine):
        directory = st.dir_for(epoch)
        missing = [r for r in batch if not (directory / hswriter.file_name(r)).exists()]
        if not missing:
            stats.skipped_batches += 1
            stats.samples += len(batch)
            stats.tokens += sum(lengths[r] for r in batch)
            continue
        prod.admit(pos, pos + len(batch), prod.est(missing), len(missing))
        yield directory, batch, missing
        stats.samples += len(batch) - len(missing)  # batch_done counts the missing ones
        stats.batch_done(b, len(mine), batch, missing, lengths, None)
        ctx.progress.update(samples=stats.samples, tokens=stats.tokens, **prod.metrics())


def finished(ctx, prod: Producer, stats, seconds: float, what: str) -> None:
    """The walk's last progress record and its log line."""
    stats.seconds = seconds
    ctx.progress.update(samples=stats.samples, tokens=stats.tokens, force=True, **prod.metrics())
    log.info(
        "%s: %d files written, %d batches skipped, waited %d times (%.1f s) for room, %.1f s",
        what,
        stats.written,
        stats.skipped_batches,
        prod.waits,
        prod.wait_s,
        stats.seconds,
    )


def prune_before(st: stream.Stream, start: tuple[int, int]) -> int:
    """Window mode, rank 0: free what train used before its resume point but had not freed
    when it was stopped (it trains from `start` on and never reads these again)."""
    if st.keep:
        return 0
    e0, k0 = start
    doomed = []
    for e in range(min(e0 + 1, len(st.orders))):
        order, ends = st.orders[e]
        upto = len(order) if e < e0 else (ends[k0 - 1] if k0 > 0 else 0)
        doomed += [st.dir_for(e) / hswriter.file_name(r) for r in order[:upto]]
    freed = stream.Ledger(st.extract_dir).free(doomed)
    if freed:
        log.info("freed %d shards train had used before its resume point", freed)
    return freed


def write_config_early(settings, info, layer_ids, lengths, hs_dir: Path) -> None:
    """data_config.json before any shard: train reads the layout from it as it starts."""
    atomic.write_json(settings.out_dir / DATA_CONFIG, data_config(info, settings, layer_ids, lengths, hs_dir))
