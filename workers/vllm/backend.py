"""The extract stage's `vllm` backend: each rank drives a vLLM engine whose TP workers capture, the ranks data parallel over one batch plan.

Each rank's driver starts an engine (engine.py: Engine, the settings eyas fixes and what it
touches inside vLLM), sends it its share of the one batch plan (dataparallel.py: share), and
rank 0 sums every engine's totals (dataparallel.py: gather).

The stage around it is the hf backend's (eyas.workers.extract: plan.py, output.py): the same
batches (a pure function of the dataset and batch_size), the same files, data_config.json,
summary.json, identity check and resume rules; `main` and `run` are this backend's side of
them. A batch is sent whole, and waited for, before the next:
vLLM's step layout is then a function of the batch alone, so a retried attempt computes the
same numbers for the files it writes. Its files are written only for samples still
missing; the others run only because they share the batch.
"""

from __future__ import annotations

import logging
import time

from eyas.state.target import default_layer_ids, num_hidden_layers
from eyas.workers.extract.output import HIDDEN_STATES_DIR, TargetInfo, claim_output, finish, identity
from eyas.workers.extract.plan import Settings, Stats, check_row, load_dataset, plan_batches, resume, row_lengths
from eyas.workers.models import hf_target
from eyas.workers.models.adapters import Decoder
from eyas.workers.runtime import phases
from eyas.workers.vllm import streaming, tpfailure
from eyas.workers.vllm import version as vllm_version
from eyas.workers.vllm.dataparallel import gather, share
from eyas.workers.vllm.engine import EXTENSION, Engine, reply_of

stage_log = logging.getLogger("eyas.extract")  # the stage's own lines (main, run), as on the hf backend


def main(ctx, settings: Settings) -> None:
    """Backend `vllm`: this rank drives a vLLM engine; its TP rank 0 worker writes the files.

    With several ranks, each drives its own engine (at tensor_parallel_size over its own GPUs:
    one engine per node under Slurm) over its share of the one batch plan (share()); rank 0
    writes data_config.json and summary.json once every rank has reported (gather())."""
    # Fail in milliseconds on what needs no engine: version, architecture, dataset.
    vllm_version.check()
    arch, adapter, model_cfg = hf_target.check(settings.target_path)
    dataset = load_dataset(settings.dataset_dir)
    lengths = row_lengths(dataset, settings.dataset_dir)
    n = num_hidden_layers(settings.target_path)
    layer_ids = Decoder(None, None, None, n, "").check_ids(settings.layer_ids or default_layer_ids(n))
    plan = share(plan_batches(lengths, 1, 0, settings.batch_size), lengths, ctx.rank, ctx.world_size)
    hs_dir = settings.out_dir / HIDDEN_STATES_DIR
    claim_output(settings.out_dir, identity(settings, arch, layer_ids, dataset))
    if settings.streaming:  # [storage] mode = "streaming": vllm/streaming.py
        per_token = streaming.per_token_bytes(settings, model_cfg, len(layer_ids))
        stream_at = streaming.prepare(ctx, settings, lengths, per_token)
    try:
        with ctx.progress.beating(  # weight load, profiling, compilation: silent minutes
            "vllm engine start",
            kind="engine_start",
            budget=phases.engine_budget(settings.target_path, settings.tensor_parallel_size),
        ):
            engine = Engine.start(
                target_path=settings.target_path,
                architecture=arch,
                dtype=settings.dtype,
                tp=settings.tensor_parallel_size,
                trust_remote_code=settings.trust_remote_code,
                layer_ids=layer_ids,
                hs_dir=hs_dir,
                max_len=max(lengths, default=1),
                options=settings.vllm_options,
                extension=settings.worker_extension or EXTENSION,
                model_cfg=model_cfg,
                hidden_dtype=settings.hidden_dtype,
                window=settings.out_dir if settings.streaming else None,
            )
        try:
            first = reply_of(engine.setup, engine.tp, 0)
            if first["num_layers"] != n:
                raise RuntimeError(
                    f"vLLM's {first['decoder_class']} has {first['num_layers']} layers; config.json says {n}"
                )
            if settings.streaming:
                info = TargetInfo(
                    arch, model_cfg.get("model_type"), adapter.family, first["decoder_path"], n, first["hidden_size"]
                )
                streaming.run(ctx, settings, engine, info, layer_ids, dataset, lengths, *stream_at, per_token)
                return
            stats, steps = run(engine, dataset, lengths, plan, hs_dir, progress=ctx.progress)
        finally:
            engine.shutdown()
    except Exception as exc:
        better = tpfailure.surfaced(exc, ctx.attempt_dir, ctx.rank)
        if better is not None:
            raise better from exc
        raise
    totals = gather(ctx, stats.totals(), steps)
    if ctx.rank != 0:
        return
    info = TargetInfo(arch, model_cfg.get("model_type"), adapter.family, first["decoder_path"], n, first["hidden_size"])
    finish(
        ctx,
        settings,
        info,
        layer_ids,
        lengths,
        hs_dir,
        totals,
        extra={
            "tensor_parallel_size": settings.tensor_parallel_size,
            "vllm": {
                "version": engine.version,
                "model_class": first["model_class"],
                "decoder_class": first["decoder_class"],
                "layer_class": first["layer_class"],
            },
        },
        summary_extra={"vllm_steps": steps, "engines": ctx.world_size},
    )


def run(engine: Engine, dataset, lengths, plan, hs_dir, progress=None) -> tuple[Stats, dict]:
    """Send this rank's `plan` to the engine, batch by batch; the workers write the files.
    Returns the stats and TP rank 0's step counts (steps, tokens, the most requests in one
    step, segments that continued a prompt from an earlier step)."""
    done, stats = resume(plan, lengths, hs_dir, progress)
    rows = dataset.with_format(None)
    t0 = time.monotonic()
    for b, batch in enumerate(plan):
        missing = [i for i in batch if i not in done]
        if not missing:
            stats.skipped_batches += 1
            continue
        items = []
        for i in batch:
            ids = [int(t) for t in rows[i]["input_ids"]]
            check_row(i, ids, lengths)
            items.append((i, ids, i not in done))
        report = engine.run(items)
        if report.get("samples") != sorted(batch):
            raise RuntimeError(f"TP rank 0 reported samples {report.get('samples')} for batch {sorted(batch)}")
        stats.batch_done(b, len(plan), batch, missing, lengths, progress)
    fin = engine.finish()
    stats.written = int(fin.get("written", 0))
    stats.seconds = time.monotonic() - t0
    if progress is not None:
        progress.update(samples=stats.samples, tokens=stats.tokens, force=True)
    steps = {k: fin[k] for k in ("steps", "tokens", "max_requests_per_step", "continued_segments") if k in fin}
    stage_log.info(
        "done: %d files written, %d batches skipped, %.1f s; %s",
        stats.written,
        stats.skipped_batches,
        stats.seconds,
        steps,
    )
    return stats, steps
