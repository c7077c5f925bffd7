"""[storage] mode = "streaming" on the vllm backend: the driver walks the stream in train's order and admits each batch into the window (extract/producer.py), and its engine's TP rank 0 worker writes the shards into each epoch's folder, counted in the window's ledger as they land.

The stream, its batches, the admission rule, the mode (keep or window), data_config.json before
any shard, the resume point and the summary are the hf backend's (extract/hf.py: _stream); only
who writes the files differs. The worker writes them in its own process, in the order the
batches were sent, so a batch is in flight until the worker's count of written files passes
the files sent before it and its own (EngineProducer). One driver rank: several engines would
need their start point and totals exchanged, which the hf backend does with torch.distributed.
"""

from __future__ import annotations

import logging
import time

from eyas.state.target import text_value
from eyas.workers.extract import producer, stream
from eyas.workers.extract.output import TargetInfo, finish, write_summary
from eyas.workers.extract.plan import Stats, check_row

log = logging.getLogger("eyas.extract")

ELEMENT_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


class EngineProducer(producer.Producer):
    """The producer of a vLLM driver: the engine's writer is in the worker process, so what has
    landed is the worker's count of written files (in send order), asked of it when needed."""

    def __init__(self, engine, *args, **kwargs):
        self.engine = engine
        self.sent = 0  # files sent to the engine so far
        super().__init__(*args, **kwargs)

    def _done_files(self) -> int:
        return self.engine.written() if self.sent else 0

    def _done_when(self, files: int) -> int:
        self.sent += files
        return self.sent


def per_token_bytes(settings, model_cfg: dict, n_ids: int) -> int:
    hidden = int(text_value(model_cfg, "hidden_size"))
    return stream.token_bytes(n_ids, hidden, ELEMENT_SIZE[settings.dtype], settings.hidden_dtype)


def prepare(ctx, settings, lengths, per_token: int) -> tuple[stream.Stream, tuple[int, int]]:
    """Before the engine loads: the stream's mode, the window's count and the resume point."""
    if ctx.world_size != 1:
        raise ValueError(
            f'streaming with extract.backend = "vllm" runs one driver rank; the run starts {ctx.world_size}: '
            "set stages.extract.ranks = 1 (its engine takes extract.tensor_parallel_size GPUs)"
        )
    producer.choose_mode(ctx, settings, lengths, per_token)
    st = stream.load(settings.out_dir, settings.dataset_dir.parent, ctx.config or {}, lengths)
    # What a killed attempt left, counted once before any batch is admitted (stream.py: Ledger).
    stream.Ledger(settings.out_dir).rebuild(st)
    start = stream.resume_point(ctx.output_dir / "train")
    if start != (0, 0):
        log.info("streaming from where train resumes: epoch %d, step %d", start[0] + 1, start[1])
    return st, start


def run(ctx, settings, engine, info: TargetInfo, layer_ids, dataset, lengths, st, start, per_token: int) -> None:
    """Walk the stream through the engine, then (window mode) stay until train is done."""
    hs_dir = settings.out_dir / "hidden_states"
    producer.write_config_early(settings, info, layer_ids, lengths, hs_dir)
    mine = producer.batches(st, start, settings.batch_size)
    producer.clear_leftovers(st, start, mine, 1, first=True)  # one driver: inflight-0.json only
    prod = EngineProducer(engine, ctx, settings, st, start, lengths, per_token)
    rows = dataset.with_format(None)
    stats, current, t0 = Stats(), None, time.monotonic()
    for directory, batch, missing in producer.walk(ctx, prod, st, mine, lengths, stats):
        if directory != current:
            engine.directory(directory)
            current = directory
        items = []
        for i in batch:
            ids = [int(t) for t in rows[i]["input_ids"]]
            check_row(i, ids, lengths)
            items.append((i, ids, i in missing))
        report = engine.run(items)
        if report.get("samples") != sorted(batch):
            raise RuntimeError(f"TP rank 0 reported samples {report.get('samples')} for batch {sorted(batch)}")
    stats.written = int(engine.finish().get("written", 0))
    prod.close()
    producer.finished(ctx, prod, stats, time.monotonic() - t0, "streaming done")
    engine.shutdown()  # its GPUs are train's from here on
    extra = {
        "streaming": st.mode,
        "window_budget_bytes": st.budget,
        "dataset_bytes": st.dataset_bytes,
        "window_peak_bytes": prod.peak(),  # the ledger's, as `eyas show` reads it (stream.Ledger)
        "extract_waits": prod.waits,
        "extract_wait_s": round(prod.wait_s, 3),
        "start": list(start),
        "tensor_parallel_size": settings.tensor_parallel_size,
    }
    if st.keep:
        finish(ctx, settings, info, layer_ids, lengths, hs_dir, stats.totals(), summary_extra=extra)
        return
    write_summary(ctx, settings, info, layer_ids, stats.totals(), extra)
    # Alive until train is done: after a failure of either half both restart, and the extractor
    # is what makes again the shards train freed after its last checkpoint.
    with ctx.progress.beating("waiting for train to finish", kind="wait", waits="train"):
        while not stream.train_done(st.extract_dir):
            time.sleep(0.2)
