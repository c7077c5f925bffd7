"""The token rows the canary sends: the run's own data, read the way the prepare stage reads it.

Preflight runs before prepare, so the prepared dataset usually does not exist yet. The rows
then come from `data.path` through prepare's own row encoder (stages/prepare.py: encode_row:
the same chat template, loss mask and max_length), skipping malformed rows as prepare does.
A run whose pipeline starts after prepare reads the prepared dataset. Only a run with neither
(an extract-only run on a dataset that is not there yet) gets seeded random token ids, and the
report says so.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

from eyas.state.regenerate import data_dir
from eyas.state.runconfig import RunConfig
from eyas.workers.data.reader import RowError, data_files, read_rows, row_byte_limit
from eyas.workers.data.target_vocab import target_vocab_size

# Lengths of the synthetic rows: short and long, so that one batch mixes them.
SYNTHETIC_LENGTHS = (57, 9, 33, 21, 64, 5, 40, 17)


def take(cfg: RunConfig, output_dir: Path, count: int) -> tuple[list[list[int]], str]:
    """Up to `count` rows of token ids, and where they came from (for the report)."""
    prepared = data_dir(output_dir, cfg.pipeline) / "dataset"
    if prepared.is_dir():
        from datasets import load_from_disk

        ds = load_from_disk(str(prepared)).with_format(None)
        rows = [list(map(int, ds[i]["input_ids"])) for i in range(min(count, len(ds)))]
        return rows, f"the first {len(rows)} rows of the prepared dataset {prepared}"
    if cfg.data is not None:
        return _from_data(cfg, count)
    vocab = target_vocab_size(cfg.target.path)
    rng = random.Random(0)
    rows = [[rng.randrange(vocab) for _ in range(n)] for n in SYNTHETIC_LENGTHS[:count]]
    return rows, "seeded random token ids (the run has no [data] and no prepared dataset yet)"


def _from_data(cfg: RunConfig, count: int) -> tuple[list[list[int]], str]:
    from eyas.workers.data.chat import MaskedRenderer, load_tokenizer
    from eyas.workers.stages.prepare import encode_row

    data, target = cfg.data, cfg.target
    vocab = target_vocab_size(target.path)

    @functools.cache
    def renderer() -> MaskedRenderer:
        return MaskedRenderer(load_tokenizer(target.path, target.trust_remote_code), where=target.path)

    rows: list[list[int]] = []
    skipped = 0
    for raw in read_rows(data_files(data.path), row_byte_limit(data.max_length)):
        try:
            ids, _, _, _ = encode_row(raw, data, vocab, renderer, target.path)
        except RowError:
            skipped += 1
            continue
        rows.append(ids)
        if len(rows) == count:
            break
    if not rows:
        raise ValueError(f"data.path: no usable row in {data.path} ({skipped} skipped); fix the data or its format")
    return (
        rows,
        f"the first {len(rows)} usable rows of {data.path} ({skipped} malformed skipped), as prepare renders them",
    )
