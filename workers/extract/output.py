"""What extract leaves under <output_dir>/extract/: the folder's identity, data_config.json and summary.json.

An output dir is bound to one extraction (claim_output): model, architecture, backend, dtype,
layer ids and data. The backend is part of it because the two compute the same states but
not the same bits; the tensor-parallel size is not, so a retry may change it (say, after
losing a GPU), at the price of last-bit differences between files. data_config.json holds no
timestamps, so that a resumed run's output is byte-identical to an uninterrupted one.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.state import contract
from eyas.workers.extract import hsformat, hswriter
from eyas.workers.extract.plan import Settings
from eyas.workers.runtime import atomic

HIDDEN_STATES_DIR = "hidden_states"
DATA_CONFIG = "data_config.json"
IDENTITY = "extract.identity.json"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TargetInfo:
    """What data_config.json says of the target, whichever backend loaded it."""

    architecture: str
    model_type: str | None
    adapter: str  # the adapter family
    decoder_path: str
    num_layers: int
    hidden_size: int


def identity(settings: Settings, arch: str, layer_ids, dataset) -> dict:
    """What an output dir is bound to (claim_output). The backend is part of it: the two
    backends compute the same states, but not to the same bits."""
    return {
        "model": str(Path(settings.target_path).resolve()),
        "architecture": arch,
        "backend": settings.backend,
        "dtype": settings.dtype,
        "layer_ids": list(layer_ids),
        "dataset": dataset_digest(dataset),
        # Only when set, so that an output dir made before [storage] existed still resumes.
        **({"hidden_dtype": settings.hidden_dtype} if settings.hidden_dtype != "target" else {}),
    }


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
    differ = atomic.claim_json(out_dir / IDENTITY, identity)
    if differ is not None:
        key, there = differ
        raise RuntimeError(
            f"{out_dir} holds the output of another extraction ({key}: {there!r} there, "
            f"{identity.get(key)!r} now); set another output_dir, or delete {out_dir} to start over"
        )


def finish(
    ctx,
    settings: Settings,
    info: TargetInfo,
    layer_ids,
    lengths,
    hs_dir: Path,
    totals: list[int],
    extra: dict | None = None,
    summary_extra: dict | None = None,
) -> None:
    """Rank 0, once every rank is done: check the files, write data_config.json and summary.json."""
    _check_complete(hs_dir, len(lengths))
    atomic.write_json(settings.out_dir / DATA_CONFIG, data_config(info, settings, layer_ids, lengths, hs_dir, extra))
    write_summary(
        ctx, settings, info, layer_ids, totals, summary_extra, [str(hs_dir), str(settings.out_dir / DATA_CONFIG)]
    )


def write_summary(
    ctx, settings: Settings, info: TargetInfo, layer_ids, totals: list[int], extra: dict | None, outputs=None
) -> None:
    """summary.json of the attempt (rank 0): what was computed, written and skipped."""
    atomic.write_json(
        ctx.attempt_dir / contract.SUMMARY,
        {
            "outputs": outputs or [str(settings.out_dir / DATA_CONFIG)],
            "samples": totals[0],
            "tokens": totals[1],
            "samples_computed": totals[2],
            "files_written": totals[3],
            "batches_skipped": totals[4],
            "layer_ids": list(layer_ids),
            "architecture": info.architecture,
            "adapter": info.adapter,
            "world_size": ctx.world_size,
            "batch_size": settings.batch_size,
            "dtype": settings.dtype,
            "hidden_dtype": settings.hidden_dtype,
            **(
                {"backend": settings.backend, "tensor_parallel_size": settings.tensor_parallel_size}
                if settings.backend != "hf"
                else {}
            ),
            **(extra or {}),
        },
    )


def _check_complete(hs_dir: Path, n: int) -> None:
    present = hswriter.existing(hs_dir)
    missing = [i for i in range(n) if i not in present]
    if missing:
        raise RuntimeError(
            f"{hs_dir}: {len(missing)} of {n} samples have no file after every rank "
            f"finished (first: {hswriter.file_name(missing[0])})"
        )


def data_config(
    info: TargetInfo,
    settings: Settings,
    layer_ids: tuple[int, ...],
    lengths: list[int],
    hs_dir: Path,
    extra: dict | None = None,
) -> dict[str, Any]:
    """What the files hold and how they were made; deterministic (no timestamps, no hosts)."""
    from eyas.workers.models.adapters import Decoder

    n = info.num_layers
    hidden_size = info.hidden_size
    return {
        "format": "speculators-hidden-states",
        "format_version": FORMAT_VERSION,
        # Paths are relative to this file's folder, so that the file does not depend on
        # where the run's output lives.
        "hidden_states_dir": os.path.relpath(hs_dir, settings.out_dir),
        "file_pattern": "hs_{idx}.safetensors",
        "tensors": tensors(settings, len(layer_ids), hidden_size),
        "layer_ids": list(layer_ids),
        "layers": [{"index": k, "id": i, "meaning": Decoder.meaning(i, n)} for k, i in enumerate(layer_ids)],
        "aux_layer_ids": list(layer_ids[:-1]),
        "verifier_last_layer_id": layer_ids[-1],
        "num_hidden_layers": n,
        "hidden_size": hidden_size,
        "dtype": settings.dtype,  # the target's, which computed the states
        # The default files are speculators' format and this file says nothing more of them.
        **(
            {"hidden_dtype": settings.hidden_dtype, "hidden_states_metadata": hsformat.FP8_METADATA}
            if settings.hidden_dtype == "fp8"
            else {}
        ),
        "model": {
            "path": settings.target_path,
            "architecture": info.architecture,
            "model_type": info.model_type,
            "adapter": info.adapter,
            "decoder": info.decoder_path,
        },
        "dataset": os.path.relpath(settings.dataset_dir, settings.out_dir),
        "num_samples": len(lengths),
        "num_tokens": sum(lengths),
        "backend": settings.backend,
        "batch_size": settings.batch_size,
        **(extra or {}),
        "versions": versions(settings.backend),
    }


def tensors(settings: Settings, n_ids: int, hidden_size: int) -> dict[str, dict]:
    """What each file holds (extract/hsformat.py), as data_config.json describes it."""
    if settings.hidden_dtype == "fp8":
        return {
            "hidden_states": {"shape": ["seq_len", n_ids, hidden_size], "dtype": "float8_e4m3fn"},
            hsformat.SCALES: {"shape": ["seq_len", n_ids, 1], "dtype": "float8_e8m0fnu"},
            "token_ids": {"shape": ["seq_len"], "dtype": "int64"},
        }
    return {
        "hidden_states": {"shape": ["seq_len", n_ids, hidden_size], "dtype": settings.dtype},
        "token_ids": {"shape": ["seq_len"], "dtype": "int64"},
    }


def versions(backend: str = "hf") -> dict[str, str | None]:
    """The versions that made the files (vLLM's only for the vllm backend)."""
    from eyas.workers.vllm import version as vllm_version

    out: dict[str, str | None] = {}
    for dist in ("torch", "transformers", "speculators", "eyas"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    if backend == "vllm":
        out["vllm"] = vllm_version.installed()[1]
    return out
