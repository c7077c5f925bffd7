"""The draft's training data: extract's hidden states plus prepare's loss masks, packed by tokens.

Inputs of one run (docs/ARCHITECTURE.md): <out>/prepare/dataset (input_ids, loss_mask, seq_len, one
row per sample), <out>/prepare/splits.json (the held-out rows), <out>/extract/hidden_states/
hs_<row>.safetensors (hidden_states [seq, n_ids, hidden], token_ids [seq]; fp8 files are
dequantised on read, extract/hsformat.py) and
<out>/extract/data_config.json (the layer ids, the last one the verifier's last hidden state).

Samples come out in speculators' layout, and packing and collation are speculators' own
(MultipackDistributedBatchSamplerV2, CollateFn, shift_batch), so a batch here is exactly the
batch its trainer would build from the same files: [1, batch_tokens, ...] with document ids
separating the packed samples and -1 marking the padding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from speculators.models.eagle3.data import shift_batch
from speculators.train.data import BaseDataset, CollateFn
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

HS_DIR = "hidden_states"


class DataError(ValueError):
    """The stage inputs are missing or do not belong together."""


@dataclass(frozen=True)
class Layout:
    """What extract wrote: which layer ids, in which order, of which width."""

    layer_ids: tuple[int, ...]  # the last one is the verifier's last hidden state
    hidden_size: int
    num_hidden_layers: int
    dtype: str
    hidden_dtype: str = "target"  # how the files store the states (extract/hsformat.py)

    @property
    def aux_ids(self) -> list[int]:
        """The draft's inputs: every id but the last (speculators' eagle_aux_hidden_state_layer_ids)."""
        return list(self.layer_ids[:-1])


def read_layout(extract_dir: Path) -> Layout:
    path = extract_dir / "data_config.json"
    if not path.exists():
        raise DataError(f'{path} does not exist: run the extract stage first (put "extract" before "train")')
    cfg = json.loads(path.read_text())
    ids = tuple(int(i) for i in cfg["layer_ids"])
    n = int(cfg["num_hidden_layers"])
    if len(ids) < 2:
        raise DataError(
            f"{path}: layer_ids {list(ids)} hold no draft input; extract at least one layer "
            "besides the last hidden state (extract.layer_ids)"
        )
    if ids[-1] != n:
        # The loss targets are lm_head(norm(h_last)): only id N is the pre-norm output of the
        # whole decoder, anything else would train the draft towards the wrong distribution.
        raise DataError(
            f"{path}: the last layer id is {ids[-1]}, but the verifier's last hidden state is id {n}; "
            f"end extract.layer_ids with {n}"
        )
    return Layout(
        layer_ids=ids,
        hidden_size=int(cfg["hidden_size"]),
        num_hidden_layers=n,
        dtype=str(cfg.get("dtype", "bfloat16")),
        # Absent from the default files' data_config.json, as from every one written before fp8.
        hidden_dtype=str(cfg.get("hidden_dtype", "target")),
    )


def read_splits(prepare_dir: Path, n_rows: int) -> tuple[list[int], list[int]]:
    """(train rows, validation rows) from prepare's splits.json."""
    path = prepare_dir / "splits.json"
    if not path.exists():
        raise DataError(f"{path} does not exist: run the prepare stage first")
    val = sorted({int(i) for i in json.loads(path.read_text()).get("validation", [])})
    bad = [i for i in val if not 0 <= i < n_rows]
    if bad:
        raise DataError(f"{path}: validation row {bad[0]} is outside the dataset's {n_rows} rows; rerun prepare")
    held = set(val)
    return [i for i in range(n_rows) if i not in held], val


class HiddenStatesDataset(BaseDataset):
    """Rows of the prepared dataset with their hidden-state files, as speculators' samples.

    Item k is dataset row `rows[k]`: {"hidden_states": [seq, n_aux * hidden] (the draft's
    inputs), "input_ids", "verifier_last_hidden_states": [seq, hidden], "loss_mask",
    "lengths", "position_ids"}. A file whose tokens differ from its row is an error, not a
    skipped sample: it means extract ran on other data.
    """

    def __init__(self, dataset, rows: list[int], hs_dir: Path, layout: Layout, max_len: int, complete: bool = True):
        self.rows = list(rows)
        self.hs_dir = Path(hs_dir)  # a streaming run points it at each epoch's shards (train/feed.py)
        self.layout = layout
        self._data = dataset.with_format("torch", columns=["input_ids", "loss_mask"])
        self._lengths = [int(n) for n in dataset.with_format(None)["seq_len"]]
        # Streaming (complete=False): the shards land while training runs.
        missing = [r for r in self.rows if complete and not (self.hs_dir / f"hs_{r}.safetensors").exists()]
        if missing:
            raise DataError(
                f"{self.hs_dir}: {len(missing)} of {len(self.rows)} samples have no hidden-states file "
                f"(first: hs_{missing[0]}.safetensors); run the extract stage to completion"
            )
        super().__init__(max_len, hidden_states_dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.rows)

    def _compute_approx_lengths(self) -> list[int]:
        return [self._lengths[r] for r in self.rows]

    def _get_raw_data(self, index: int) -> dict[str, Any]:
        from eyas.workers.extract import hsformat

        row = self.rows[index]
        path = self.hs_dir / f"hs_{row}.safetensors"
        try:
            sample = hsformat.read(path)  # fp8 comes back dequantised, in float32
        except hsformat.FormatError as exc:
            raise DataError(str(exc)) from None
        if sample.hidden_dtype != self.layout.hidden_dtype:
            raise DataError(
                f"{path}: stored as hidden_dtype {sample.hidden_dtype!r}, but data_config.json says "
                f"{self.layout.hidden_dtype!r}; the folder mixes two extractions: rerun extract into a fresh output_dir"
            )
        hs, token_ids = sample.hidden_states, sample.token_ids
        item = self._data[row]
        if hs.ndim != 3 or hs.shape[1] != len(self.layout.layer_ids) or hs.shape[2] != self.layout.hidden_size:
            raise DataError(
                f"{path}: hidden_states has shape {tuple(hs.shape)}, expected [seq, "
                f"{len(self.layout.layer_ids)}, {self.layout.hidden_size}] (data_config.json); "
                "rerun extract into a fresh output_dir"
            )
        if not torch.equal(token_ids, item["input_ids"].to(token_ids.dtype)):
            raise DataError(
                f"{path}: its token_ids differ from row {row} of the prepared dataset; the hidden states "
                "belong to other data: rerun extract after prepare"
            )
        return {
            "hidden_states": hs[:, :-1].flatten(1),  # the draft's inputs, layers side by side
            "input_ids": token_ids,
            "verifier_last_hidden_states": hs[:, -1],
            "loss_mask": item["loss_mask"],
        }


def plan(lengths: list[int], batch_tokens: int, world_size: int, rank: int, seed: int, epoch: int) -> list[list[int]]:
    """This rank's batches (indices into `lengths`) for one epoch: speculators' LPT packing of a
    seeded shuffle. A pure function, the same on every rank, so that every rank runs the same
    number of steps and a resumed attempt replays exactly the batches it skips."""
    import warnings

    if len(lengths) < world_size:
        return []
    sampler = MultipackDistributedBatchSamplerV2(batch_tokens, lengths, world_size, rank, seed=seed)
    sampler.set_epoch(epoch)
    with warnings.catch_warnings():
        # "samples longer than batch_max_length will be truncated": said once, by the stage.
        warnings.simplefilter("ignore")
        return [[int(i) for i in b] for b in sampler]


def batch_tokens_of(batch: list[int], lengths: list[int], budget: int) -> int:
    """Positions a packed batch trains on: each sample loses one to the shift, the pack is cut at the budget."""
    return min(sum(max(lengths[i] - 1, 0) for i in batch), budget)


def collate_fn(batch_tokens: int, layout: Layout, dtype) -> CollateFn:
    """speculators' collation: shift each sample (token t+1 with the hidden state of t), pack,
    pad to `batch_tokens`, number the documents."""
    return CollateFn(
        batch_tokens, layout.hidden_size, num_target_layers=len(layout.aux_ids), dtype=dtype, preprocess=shift_batch
    )


class _Batches(torch.utils.data.Sampler):
    """A fixed list of batches for torch's DataLoader (its batch_sampler); `before(k)` runs
    before batch k is handed out (streaming: wait for its shards, train/feed.py)."""

    def __init__(self, batches: list[list[int]], before=None):
        self.batches = batches
        self.before = before

    def __iter__(self):
        for k, batch in enumerate(self.batches):
            if self.before is not None:
                self.before(k)
            yield batch

    def __len__(self) -> int:
        return len(self.batches)


def loader(
    dataset: HiddenStatesDataset,
    batches: list[list[int]],
    collate: CollateFn,
    num_workers: int = 0,
    pin_memory: bool = False,
    before=None,
):
    """Iterate collated batches. Workers prefetch on GPU hosts; on CPU they would take cores
    from the training step, so 0 (load in the loop) is the default there."""
    from torch.utils.data import DataLoader

    return DataLoader(
        dataset,
        batch_sampler=_Batches(batches, before),
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=4 if num_workers else None,
        persistent_workers=False,
        multiprocessing_context="spawn" if num_workers else None,
    )
