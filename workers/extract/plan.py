"""What one extract rank computes: its settings, its batches (a pure function of the dataset), and what is already done.

The batches are a pure function of (dataset, world_size, rank, batch_size) and never of what is
already on disk: a retried attempt recomputes exactly the batches an uninterrupted run computes,
skips those whose files all exist and writes only the missing files of the others. Both backends
(extract/hf.py, vllm/backend.py) walk a plan made here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.state.drafttables import ExtractConfig, StorageConfig
from eyas.state.executiontables import ResourcesConfig
from eyas.state.inputtables import TargetConfig
from eyas.state.regenerate import data_dir
from eyas.state.runconfig import stage_options
from eyas.workers.extract import hswriter

log = logging.getLogger("eyas.extract")


@dataclass(frozen=True)
class Settings:
    target_path: str
    dtype: str
    trust_remote_code: bool
    layer_ids: tuple[int, ...] | None  # None: config.default_layer_ids(N)
    batch_size: int
    device: str  # "cpu" or "cuda"
    dataset_dir: Path
    out_dir: Path  # <output_dir>/extract
    backend: str = "hf"
    tensor_parallel_size: int = 1
    vllm_options: dict | None = None  # more vLLM engine arguments ([stages.extract] options.vllm)
    worker_extension: str | None = None  # another vLLM worker extension class (a subclass of eyas's)
    hidden_dtype: str = "target"  # [storage] hidden_dtype: how the files store the states (extract/hsformat.py)
    streaming: bool = False  # [storage] mode = "streaming" (extract/stream.py)

    @classmethod
    def from_context(cls, ctx) -> Settings:
        return cls.from_config(ctx.config or {}, ctx.options or {}, ctx.output_dir, ctx.stage_dir)

    @classmethod
    def from_config(cls, cfg: dict, options: dict, output_dir: Path, out_dir: Path) -> Settings:
        """The settings of an extraction of the run `cfg` (its dict form) with [stages.extract]
        `options`, reading the run's dataset (<output_dir>/prepare/dataset, or regenerate/dataset when the
        pipeline has regenerate: state/regenerate.py) and writing under `out_dir`."""
        target = cfg.get("target")
        if not target:
            raise ValueError(
                "extract needs the run config's [target] (EYAS_CONFIG names no target); "
                'add a [target] table with path = "<model directory>"'
            )
        # The tables as the run was submitted with them, checked then (state/runconfig.py);
        # read through their models here, so no key's type or default is restated.
        target = TargetConfig.model_validate(target)
        ex = ExtractConfig.model_validate(cfg.get("extract") or {})
        devices = ResourcesConfig.model_validate(cfg.get("resources") or {}).devices
        # Checked when the run was submitted (state/specs.py: ExtractOptions).
        extract_options = stage_options("extract", options)
        return cls(
            target_path=target.path,
            dtype=target.dtype,
            trust_remote_code=target.trust_remote_code,
            layer_ids=ex.layer_ids,
            batch_size=ex.batch_size,
            device=_device(devices),
            dataset_dir=data_dir(output_dir, cfg.get("pipeline")) / "dataset",  # prepare's or regenerate's
            out_dir=out_dir,
            backend=ex.backend,
            tensor_parallel_size=ex.tensor_parallel_size,
            vllm_options=extract_options.vllm,
            worker_extension=extract_options.worker_extension,
            hidden_dtype=StorageConfig.model_validate(cfg.get("storage") or {}).hidden_dtype,
            streaming=(cfg.get("storage") or {}).get("mode") == "streaming",
        )


def _device(devices: Any) -> str:
    if devices == "cpu":
        return "cpu"
    import torch

    # The daemon narrows CUDA_VISIBLE_DEVICES to this rank's GPU, so it is always cuda:0.
    return "cuda" if torch.cuda.is_available() else "cpu"


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
    return [mine[k : k + batch_size] for k in range(0, len(mine), batch_size)]


@dataclass
class Stats:
    samples: int = 0  # samples of this rank done (present on disk or written now)
    tokens: int = 0
    computed: int = 0  # samples whose batch ran in this attempt
    written: int = 0  # files written in this attempt
    skipped_batches: int = 0  # batches whose files all existed
    seconds: float = 0.0  # wall time of the batch loop

    def batch_done(self, b: int, n_batches: int, batch, missing, lengths, progress) -> None:
        """Count a batch that ran (both backends), report it, and log every 20th."""
        self.computed += len(batch)
        self.samples += len(missing)
        self.tokens += sum(lengths[i] for i in missing)
        if progress is not None:
            progress.update(samples=self.samples, tokens=self.tokens)
        if b % 20 == 0 or b == n_batches - 1:
            log.info("batch %d/%d: %d samples, %d tokens done", b + 1, n_batches, self.samples, self.tokens)

    def totals(self) -> list[int]:
        """What finish() sums over the ranks, in its order."""
        return [self.samples, self.tokens, self.computed, self.written, self.skipped_batches]


def resume(plan, lengths, hs_dir: Path, progress=None) -> tuple[set[int], Stats]:
    """The rows of `plan` whose files already exist, and the stats this attempt starts from.

    Removes the temp files an earlier attempt left for these rows, and reports the starting
    point (with this rank's totals) as progress."""
    mine = {i for batch in plan for i in batch}
    done = hswriter.existing(hs_dir) & mine
    if hswriter.remove_temp_files(hs_dir, mine):
        log.info("removed temp files left by an earlier attempt")
    stats = Stats(samples=len(done), tokens=sum(lengths[i] for i in done))
    if done:
        log.info("resuming: %d of %d samples already extracted", len(done), len(mine))
    if progress is not None:
        progress.update(
            samples=stats.samples,
            tokens=stats.tokens,
            samples_total=len(mine),
            tokens_total=sum(lengths[i] for i in mine),
            force=True,
        )
    return done, stats


def check_row(i: int, ids, lengths) -> None:
    if len(ids) != lengths[i]:
        raise ValueError(
            f"dataset row {i}: seq_len {lengths[i]} but {len(ids)} input_ids; "
            "the prepared dataset is inconsistent: run prepare again"
        )


def load_dataset(path: Path):
    """prepare's dataset (input_ids, loss_mask, seq_len), or a message saying to run prepare."""
    from datasets import load_from_disk

    if not path.is_dir():
        raise FileNotFoundError(
            f'{path}: no prepared dataset; run the prepare stage first (put "prepare" before "extract" in the pipeline)'
        )
    ds = load_from_disk(str(path))
    missing = [c for c in ("input_ids", "seq_len") if c not in ds.column_names]
    if missing:
        raise ValueError(
            f"{path}: the dataset has no {missing[0]} column; it must come from the prepare "
            "stage (input_ids, loss_mask, seq_len)"
        )
    return ds


def row_lengths(dataset, path: Path) -> list[int]:
    """Every row's seq_len; a row without tokens is refused."""
    lengths = [int(n) for n in dataset.with_format(None)["seq_len"]]
    empty = [i for i, n in enumerate(lengths) if n < 1]
    if empty:
        raise ValueError(f"{path}: row {empty[0]} has no tokens; prepare drops such rows: run it again")
    return lengths
