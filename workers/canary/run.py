"""Run a run's real extraction path on a shrunken, dummy-weight copy of its target, check what it captured, and report.

The canary is the extract stage's own code with two things swapped: the target (a copy of
its config.json with fewer layers and experts, canary/shrink.py, beside the target's other
files, without its weights) and the weights (vLLM's `load_format = "dummy"`; random init on
the hf backend). Everything else is the run's: backend, worker extension, tensor-parallel
size, engine options, dtype, device, model class, the chat data (canary/samples.py) and the
batch plan. A bug in that path (the seed's: a worker extension calling `get_input_embeddings`
on a DeepseekV2Model) raises here, in the same worker, with the same traceback, after seconds
of start-up instead of after the whole target has loaded.

What it checks of the files the path wrote (speculators' format, extract/hswriter.py): one per
sample, `hidden_states` of shape [tokens, layer ids, hidden size] in the run's dtype, finite,
`token_ids` equal to the row sent; and per-request slicing: a prefix of the first row is sent
as a request of its own, and its states must equal the first row's over those positions
(attention is causal, so only a mis-sliced step makes them differ).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from eyas.state import contract
from eyas.state.runconfig import RunConfig
from eyas.state.target import default_layer_ids, read_model_config, text_value
from eyas.workers.canary import samples
from eyas.workers.canary.shrink import Shrunk, shrink
from eyas.workers.extract.plan import Settings, plan_batches
from eyas.workers.runtime import phases

log = logging.getLogger("eyas.canary")

# Weight files the canary leaves behind: every other file of the target folder (tokenizer,
# generation config, the model's own code for trust_remote_code) is linked into the copy.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# At most this many samples per batch and two batches: enough to mix lengths and split
# prompts across steps, few enough to stay seconds on a CPU.
MAX_BATCH = 4
BATCHES = 2
# How far the prefix twin may drift from the first row's states, as a fraction of their
# largest magnitude: a different batch composition reorders float sums (bf16 on GPUs most of
# all), while a mis-sliced request carries another prompt's states, off by their full size.
TWIN_TOLERANCE = 0.05


class CanaryFailed(RuntimeError):
    """The canary ran, but what it captured is wrong (or a worker said why it failed)."""


def settings_of(cfg: RunConfig, output_dir: Path, workdir: Path) -> Settings:
    stage = cfg.stages.get("extract")
    return Settings.from_config(cfg.to_dict(), stage.options if stage else {}, output_dir, workdir)


def build_target(target_path: str, config: dict[str, Any], into: Path) -> Path:
    """A folder that is the target without its weights and with the canary's config.json."""
    import json

    into.mkdir(parents=True, exist_ok=True)
    for entry in Path(target_path).iterdir():
        if entry.name == "config.json" or entry.name in WEIGHT_INDEXES or entry.name.endswith(WEIGHT_SUFFIXES):
            continue
        (into / entry.name).symlink_to(entry.resolve())
    (into / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return into


def run(cfg: RunConfig, output_dir: Path, workdir: Path, progress=None) -> dict[str, Any]:
    """Run the canary of `cfg`'s extraction in `workdir` (emptied first, its outputs removed after);
    returns the report. Raises what the path raised, or CanaryFailed on a wrong capture."""
    t0 = time.monotonic()
    shutil.rmtree(workdir, ignore_errors=True)
    settings = settings_of(cfg, output_dir, workdir)
    model_cfg = read_model_config(settings.target_path)
    n = text_value(model_cfg, "num_hidden_layers")
    shrunk = shrink(model_cfg, tuple(settings.layer_ids or default_layer_ids(n)))
    target_dir = build_target(settings.target_path, shrunk.config, workdir / "target")
    batch = max(1, min(settings.batch_size, MAX_BATCH))
    rows, source = samples.take(cfg, output_dir, batch * BATCHES - 1)
    rows.append(rows[0][: max(1, len(rows[0]) // 2)])  # the prefix twin
    log.info(
        "canary: %s backend at TP %d, %s, dummy weights; %d of %d layers, ids %s -> %s (%s); %s; %d samples from %s",
        settings.backend,
        settings.tensor_parallel_size,
        settings.worker_extension or "eyas's worker extension",
        shrunk.canary_layers,
        shrunk.num_layers,
        list(shrunk.layer_ids),
        list(shrunk.canary_ids),
        "0 and N kept, the ids between read layers 1, 2, ... in order",
        ", ".join(f"{k} {a} -> {b}" for k, (a, b) in shrunk.changes.items()) or "nothing else shrunk",
        len(rows),
        source,
    )
    hs_dir = workdir / "hidden_states"
    lengths = [len(r) for r in rows]
    plan = plan_batches(lengths, 1, 0, batch)
    dataset = _dataset(rows)
    prepared = time.monotonic()
    if settings.backend == "vllm":
        engine_info = _run_vllm(settings, shrunk, target_dir, dataset, lengths, plan, hs_dir, workdir, progress)
    else:
        engine_info = _run_hf(settings, shrunk, target_dir, dataset, lengths, plan, hs_dir, progress)
    ran = time.monotonic()
    hidden = int(text_value(shrunk.config, "hidden_size"))
    twin = verify(hs_dir, rows, len(shrunk.canary_ids), hidden, settings.dtype)
    shutil.rmtree(hs_dir, ignore_errors=True)
    report = {
        "backend": settings.backend,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "worker_extension": settings.worker_extension,
        "device": settings.device,
        "dtype": settings.dtype,
        **shrunk.as_json(),
        **engine_info,
        "samples": len(rows),
        "tokens": sum(lengths),
        "batches": len(plan),
        "data": source,
        "hidden_size": hidden,
        "twin_max_abs_diff": twin,
        "seconds": {
            "prepare": round(prepared - t0, 2),
            "run": round(ran - prepared, 2),
            "total": round(time.monotonic() - t0, 2),
        },
    }
    log.info(
        "canary passed in %.1f s: %d samples, %d tokens, %d batches; captures [tokens, %d, %d] %s; twin within %.2g",
        report["seconds"]["total"],
        len(rows),
        sum(lengths),
        len(plan),
        len(shrunk.canary_ids),
        hidden,
        settings.dtype,
        twin,
    )
    return report


def _dataset(rows: list[list[int]]):
    import datasets

    return datasets.Dataset.from_dict(
        {"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows], "seq_len": [len(r) for r in rows]}
    )


def _run_vllm(settings: Settings, shrunk: Shrunk, target_dir: Path, dataset, lengths, plan, hs_dir, workdir, progress):
    from eyas.workers.models import hf_target
    from eyas.workers.vllm import backend

    arch, _, _ = hf_target.check(str(target_dir))
    options = {**(settings.vllm_options or {}), "load_format": "dummy"}
    with worker_records(workdir):
        with engine_start(progress):
            engine = backend.Engine.start(
                target_path=str(target_dir),
                architecture=arch,
                dtype=settings.dtype,
                tp=settings.tensor_parallel_size,
                trust_remote_code=settings.trust_remote_code,
                layer_ids=shrunk.canary_ids,
                hs_dir=hs_dir,
                max_len=max(lengths),
                options=options,
                extension=settings.worker_extension or backend.EXTENSION,
                model_cfg=shrunk.config,
            )
        try:
            first = backend.reply_of(engine.setup, engine.tp, 0)
            if first["num_layers"] != shrunk.canary_layers:
                raise CanaryFailed(
                    f"vLLM's {first['decoder_class']} has {first['num_layers']} layers; the canary's "
                    f"config.json says {shrunk.canary_layers}"
                )
            _, steps = backend.run(engine, dataset, lengths, plan, hs_dir)
        finally:
            engine.shutdown()
    return {
        "vllm": engine.version,
        "model_class": first["model_class"],
        "decoder_class": first["decoder_class"],
        "layer_class": first["layer_class"],
        "vllm_steps": steps,
    }


def _run_hf(settings: Settings, shrunk: Shrunk, target_dir: Path, dataset, lengths, plan, hs_dir, progress):
    from eyas.workers.extract import hf
    from eyas.workers.models import hf_target

    target = hf_target.load(
        str(target_dir), settings.dtype, settings.trust_remote_code, settings.device, random_weights=True
    )
    if target.decoder.num_layers != shrunk.canary_layers:
        raise CanaryFailed(
            f"{type(target.decoder.module).__name__} has {target.decoder.num_layers} layers; the canary's "
            f"config.json says {shrunk.canary_layers}"
        )
    ids = target.decoder.check_ids(shrunk.canary_ids)
    hf.run(target, ids, dataset, lengths, plan, hs_dir, settings.dtype, settings.device, progress=progress)
    return {"model_class": type(target.model).__name__, "decoder_class": type(target.decoder.module).__name__}


@contextlib.contextmanager
def worker_records(workdir: Path):
    """Outside a daemon's attempt (eyas doctor --canary) the engine's workers record their errors
    in `workdir`, and a failure raises CanaryFailed naming the worker and its traceback, as the
    daemon would; inside one, the attempt's own records serve and nothing changes."""
    own = contract.ATTEMPT_DIR not in os.environ
    if own:
        os.environ[contract.ATTEMPT_DIR] = str(workdir)
    try:
        yield
    except Exception as exc:
        worker = worker_error(workdir) if own else None
        if worker is not None:
            raise CanaryFailed(worker) from exc
        raise
    finally:
        if own:
            os.environ.pop(contract.ATTEMPT_DIR, None)


def engine_start(progress):
    """The canary engine's start, as a bounded phase of the rank's heartbeat (none under the doctor)."""
    if progress is None:
        return contextlib.nullcontext()
    return progress.beating("canary engine start", kind="engine_start", budget=phases.engine_budget(None))


def worker_error(attempt_dir: Path) -> str | None:
    """The first TP worker's recorded error in `attempt_dir`, as 'TP worker k: Type: message' and its traceback."""
    import json

    # The workers the daemon would read: those registered (contract.TP_PROC_GLOB), each with its
    # own error file, as daemon/tpworkers.py reads them.
    found = []
    for proc in attempt_dir.glob(contract.TP_PROC_GLOB):
        k = contract.tp_rank_of(proc.name)
        try:
            rec = json.loads((attempt_dir / contract.tp_file(k, contract.ERROR)).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        found.append((rec.get("time") or 0, k, rec))
    if not found:
        return None
    _, k, rec = min(found, key=lambda f: (f[0], f[1]))
    head = f"TP worker {k}: {rec.get('type')}: {rec.get('message')}"
    return f"{head}\n{rec.get('traceback') or ''}".rstrip()


def verify(hs_dir: Path, rows: list[list[int]], n_ids: int, hidden: int, dtype: str) -> float:
    """Check every captured file (see the module docstring); returns the prefix twin's largest
    difference from the first row. CanaryFailed names the first file that is wrong."""
    import torch
    from safetensors.torch import load_file

    from eyas.workers.extract.hswriter import file_name

    want_dtype = getattr(torch, dtype)
    states = {}
    for i, row in enumerate(rows):
        path = hs_dir / file_name(i)
        if not path.exists():
            raise CanaryFailed(f"sample {i}: no {path.name} was written")
        got = load_file(path)
        h, ids = got.get("hidden_states"), got.get("token_ids")
        if h is None or ids is None:
            raise CanaryFailed(f"{path.name} holds {sorted(got)}, not hidden_states and token_ids")
        if tuple(h.shape) != (len(row), n_ids, hidden):
            raise CanaryFailed(
                f"{path.name}: hidden_states of shape {tuple(h.shape)}, expected {(len(row), n_ids, hidden)} "
                "(tokens, layer ids, hidden size)"
            )
        if h.dtype != want_dtype:
            raise CanaryFailed(f"{path.name}: hidden_states in {h.dtype}, the run's dtype is {dtype}")
        if ids.tolist() != row:
            raise CanaryFailed(f"{path.name}: token_ids are not sample {i}'s ({ids.tolist()[:8]}... vs {row[:8]}...)")
        if not torch.isfinite(h).all():
            raise CanaryFailed(f"{path.name}: hidden_states hold NaN or inf")
        states[i] = h.float()
    first, twin = states[0], states[len(rows) - 1]
    diff = (twin - first[: twin.shape[0]]).abs().max().item()
    scale = first[: twin.shape[0]].abs().max().item()
    if diff > TWIN_TOLERANCE * scale + 1e-6:
        raise CanaryFailed(
            f"per-request slicing: sample {len(rows) - 1} (the first {twin.shape[0]} tokens of sample 0) differs "
            f"from sample 0 by up to {diff:.3g} (its states reach {scale:.3g}): the capture mixed up requests"
        )
    return diff
