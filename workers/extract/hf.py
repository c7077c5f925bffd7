"""The extract stage's `hf` backend: transformers, one model per rank, the ranks data parallel over the samples.

Each rank loads the target, runs its own plan (extract/plan.py) batch by batch with forward
pre-hooks at the run's layer ids (models/capture.py), and hands each batch's states to the
background writer (extract/hswriter.py); rank 0 writes data_config.json and summary.json once
every rank is done (extract/output.py). On a CUDA out-of-memory a batch is run again as two halves.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from pathlib import Path

from eyas.state.target import default_layer_ids
from eyas.workers.extract import hswriter
from eyas.workers.extract.output import HIDDEN_STATES_DIR, TargetInfo, claim_output, finish, identity
from eyas.workers.extract.plan import Settings, Stats, check_row, load_dataset, plan_batches, resume, row_lengths
from eyas.workers.runtime import phases
from eyas.workers.runtime.cpu_share import passive_waits, share_cpus

log = logging.getLogger("eyas.extract")


def main(ctx, settings: Settings) -> None:
    """Backend `hf`: this rank loads the target and writes the files of its own batches."""
    if settings.device == "cpu":
        passive_waits()  # before anything loads torch (the dataset does)
    from eyas.workers.models import hf_target

    # Fail at once on an unknown architecture, before the dataset or any weight is read.
    arch, adapter, _ = hf_target.check(settings.target_path)
    dataset = load_dataset(settings.dataset_dir)
    lengths = row_lengths(dataset, settings.dataset_dir)

    if settings.device == "cpu":
        from eyas.workers.extract.stream import sibling_ranks

        share_cpus(ctx.world_size, sibling_ranks(ctx.config or {}, "extract"))
    import torch

    from eyas.workers.runtime.dist import Dist

    # gloo even on GPUs: it only sums a few counts. Ranks may finish far apart, hence the long timeout.
    dist = Dist(ctx, backend="gloo", timeout=timedelta(hours=12))
    done = False
    try:
        with ctx.progress.beating(  # minutes for a large model, and silent
            "load target",
            kind="load",
            budget=phases.load_budget(settings.target_path),
            evidence=phases.io_evidence,
        ):
            target = hf_target.load(settings.target_path, settings.dtype, settings.trust_remote_code, settings.device)
        n = target.decoder.num_layers
        layer_ids = target.decoder.check_ids(settings.layer_ids or default_layer_ids(n))
        hs_dir = settings.out_dir / HIDDEN_STATES_DIR
        claim_output(settings.out_dir, identity(settings, arch, layer_ids, dataset))
        if settings.streaming:
            _stream(ctx, settings, target, layer_ids, dataset, lengths, hs_dir, dist)
            done = True
            return
        plan = plan_batches(lengths, ctx.world_size, ctx.rank, settings.batch_size)
        stats = run(
            target,
            layer_ids,
            dataset,
            lengths,
            plan,
            hs_dir,
            settings.dtype,
            settings.device,
            progress=ctx.progress,
            hidden_dtype=settings.hidden_dtype,
        )
        # Also the barrier: every rank's files are written by the time the sums arrive.
        totals = dist.all_reduce(torch.tensor(stats.totals(), dtype=torch.int64)).tolist()
        if ctx.rank == 0:
            finish(ctx, settings, target_info(target), layer_ids, lengths, hs_dir, totals)
        done = True
    finally:
        dist.close(barrier=done)  # no barrier after a failure: the other ranks may be anywhere


def _stream(ctx, settings: Settings, target, layer_ids, dataset, lengths, hs_dir: Path, dist) -> None:
    """[storage] mode = "streaming": this rank's share of the stream, in train's order and
    inside the window (extract/producer.py, extract/stream.py)."""
    import torch

    from eyas.workers.extract import producer, stream
    from eyas.workers.extract.output import write_summary

    n_ids, size = len(layer_ids), hidden_size(target)
    element = torch.empty((), dtype=getattr(torch, settings.dtype)).element_size()
    per_token = stream.token_bytes(n_ids, size, element, getattr(settings, "hidden_dtype", "target"))
    if ctx.rank == 0:
        producer.choose_mode(ctx, settings, lengths, per_token)
        producer.write_config_early(settings, target_info(target), layer_ids, lengths, hs_dir)
    else:
        stream.wait_for(stream.plan_path(settings.out_dir), ctx.progress, "waiting for rank 0's stream plan")  # a peer
    st = stream.load(settings.out_dir, settings.dataset_dir.parent, ctx.config or {}, lengths)
    if ctx.rank == 0:
        # The window's count, from what a killed attempt left; before the all_reduce below, so
        # before any rank admits a batch against it (stream.py: Ledger).
        stream.Ledger(settings.out_dir).rebuild(st)
    # Rank 0's reading of train's checkpoint, on every rank: positions in the stream count from it.
    mine = list(stream.resume_point(ctx.output_dir / "train")) if ctx.rank == 0 else [0, 0]
    start = tuple(int(v) for v in dist.all_reduce(torch.tensor(mine, dtype=torch.int64)).tolist())
    if start != (0, 0):
        log.info("streaming from where train resumes: epoch %d, step %d", start[0] + 1, start[1])
    stats = Stats()
    prod = producer.run(ctx, settings, target, layer_ids, dataset, lengths, st, start, stats, per_token)
    figures = [prod.waits, int(prod.wait_s * 1000)]
    totals = dist.all_reduce(torch.tensor(stats.totals() + figures, dtype=torch.int64)).tolist()
    if ctx.rank != 0:
        return
    extra = {
        "streaming": st.mode,
        "window_budget_bytes": st.budget,
        "dataset_bytes": st.dataset_bytes,
        # The ledger's peak, read after the all_reduce above (every rank's shards have landed) and
        # published as the metric `eyas show` reads: one number in both (stream.Ledger says why).
        "window_peak_bytes": prod.peak(),
        "extract_waits": totals[5],
        "extract_wait_s": totals[6] / 1000,
        "start": list(start),
    }
    if st.keep:
        finish(ctx, settings, target_info(target), layer_ids, lengths, hs_dir, totals[:5], summary_extra=extra)
    else:
        write_summary(ctx, settings, target_info(target), layer_ids, totals[:5], extra)


def target_info(target) -> TargetInfo:
    return TargetInfo(
        target.architecture,
        target.model_type,
        target.adapter.family,
        target.decoder.path,
        target.decoder.num_layers,
        hidden_size(target),
    )


def run(
    target,
    layer_ids,
    dataset,
    lengths,
    plan,
    hs_dir: Path,
    dtype: str,
    device: str = "cpu",
    progress=None,
    max_pending: int = 2,
    hidden_dtype: str = "target",
) -> Stats:
    """Compute this rank's `plan` and write its missing files; returns what was done."""
    import torch

    from eyas.workers.models.capture import LayerCapture

    done, stats = resume(plan, lengths, hs_dir, progress)
    rows = dataset.with_format(None)
    pad_id = _pad_id(target.model)
    torch_dtype = getattr(torch, dtype)
    size = hidden_size(target)
    writer = hswriter.HiddenStatesWriter(hs_dir, max_pending=max_pending, hidden_dtype=hidden_dtype)
    capture = LayerCapture(target.decoder, layer_ids)
    t0 = time.monotonic()
    try:
        with torch.inference_mode(), capture:
            for b, batch in enumerate(plan):
                missing = [i for i in batch if i not in done]
                if not missing:
                    stats.skipped_batches += 1
                    continue
                token_ids = [rows[i]["input_ids"] for i in batch]
                for i, ids in zip(batch, token_ids):
                    check_row(i, ids, lengths)
                hidden = _buffer(token_ids, len(layer_ids), size, torch_dtype, device)
                _forward(target.decoder, capture, token_ids, pad_id, device, hidden)
                writer.put(job(hidden, batch, token_ids, set(missing), device))
                stats.batch_done(b, len(plan), batch, missing, lengths, progress)
    except BaseException:
        writer.abort()  # the loop's own error is the one to report
        raise
    writer.close()
    stats.written = writer.written
    stats.seconds = time.monotonic() - t0
    if progress is not None:
        progress.update(samples=stats.samples, tokens=stats.tokens, force=True)
    log.info(
        "rank done: %d files written, %d batches skipped, %.1f s", stats.written, stats.skipped_batches, stats.seconds
    )
    return stats


def _pad_id(model) -> int:
    # Any valid id works: padded positions are masked out and sliced off.
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    return pad if isinstance(pad, int) else 0


def pad_batch(token_ids: list[list[int]], pad_id: int, device: str = "cpu"):
    """(input_ids, attention_mask), right-padded to the longest sample."""
    import torch

    width = max(len(t) for t in token_ids)
    ids = torch.full((len(token_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_ids), width), dtype=torch.long)
    for row, t in enumerate(token_ids):
        ids[row, : len(t)] = torch.tensor(t, dtype=torch.long)
        mask[row, : len(t)] = 1
    return ids.to(device), mask.to(device)


def _buffer(token_ids: list[list[int]], n_ids: int, hidden_size: int, dtype, device: str):
    """A fresh [batch, seq, n_ids, hidden] host buffer for one batch (the writer owns the last one).

    Pinned when the model runs on a GPU, so that the hooks' copies into it are asynchronous.
    """
    import torch

    shape = (len(token_ids), max(len(t) for t in token_ids), n_ids, hidden_size)
    return torch.empty(shape, dtype=dtype, pin_memory=device != "cpu")


def _forward(decoder, capture, token_ids: list[list[int]], pad_id: int, device: str, out, row: int = 0) -> None:
    """Run one batch, its streams landing in out[row:row + len(token_ids)]; on a CUDA
    out-of-memory, run it again as two halves."""
    import torch

    try:
        ids, mask = pad_batch(token_ids, pad_id, device)
        capture.into(out[row : row + len(token_ids), : ids.shape[1]])
        decoder.module(input_ids=ids, attention_mask=mask, use_cache=False)
        capture.finish()
    except torch.OutOfMemoryError:
        capture.clear()  # whatever the failed forward had reached
        if len(token_ids) == 1:
            raise
        half = len(token_ids) // 2
        log.warning("out of memory on a batch of %d samples: running it as two halves", len(token_ids))
        if device != "cpu":
            torch.cuda.empty_cache()
        _forward(decoder, capture, token_ids[:half], pad_id, device, out, row)
        _forward(decoder, capture, token_ids[half:], pad_id, device, out, row + half)


def job(hidden, batch: list[int], token_ids: list[list[int]], missing: set[int], device: str) -> hswriter.Job:
    """The writer's job for one computed batch: the files of its `missing` rows."""
    import torch

    ready = None
    if device != "cpu":
        # The hooks' copies into the pinned buffer are queued on the compute stream; the
        # writer waits for this event instead of the loop waiting for the copies.
        ready = torch.cuda.Event()
        ready.record()
    items = [
        hswriter.Item(
            idx=i, row=row, length=len(token_ids[row]), token_ids=torch.tensor(token_ids[row], dtype=torch.int64)
        )
        for row, i in enumerate(batch)
        if i in missing
    ]
    return hswriter.Job(hidden=hidden, items=items, ready=ready)


def hidden_size(target) -> int:
    cfg = getattr(target.decoder.module, "config", None)
    size = getattr(cfg, "hidden_size", None)
    if isinstance(size, int):
        return size
    return int(target.decoder.norm.weight.shape[-1])
