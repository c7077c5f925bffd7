"""The training rows' token lengths as the CLI can know them without an engine: the prepared dataset's own when prepare has run, else an estimate from the data file, each row read and parsed as prepare reads it.

`eyas init` sizes training from them and `eyas validate` counts a config's optimizer steps on them
(state/trainsteps.py). The estimate tokenizes each turn's text with the target's tokenizer.json
(the `tokenizers` library: no torch) and leaves the chat template's own tokens out, so it errs
low, and a schedule sized on it takes at least the steps it promises; without a tokenizer.json
it is the text's bytes ÷ 4. The prepared dataset is an arrow file: pyarrow reads it in a child
process, since it loads numpy, which the CLI never does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from eyas.state import trainsteps
from eyas.state.inputtables import DataConfig

BYTES_PER_TOKEN = 4  # without a tokenizer, as the doctor estimates (workers/doctor/disk.py)
# Past this many bytes of rows the rest of the data is not read: the rows read stand for the
# others (their lengths repeated for the files' remaining bytes); such data is far above MIN_STEPS,
# and reading all of a large dataset would take init and validate minutes.
SAMPLE_BYTES = 16 << 20

# Run by `python -c` in a child: every row's seq_len, in the dataset's order, as one JSON list.
_READ_SEQ_LEN = """
import json, sys
import pyarrow as pa, pyarrow.ipc as ipc
folder = sys.argv[1]
state = json.load(open(folder + "/state.json"))
out = []
for f in state["_data_files"]:
    with pa.memory_map(folder + "/" + f["filename"]) as src:
        for batch in ipc.open_stream(src):
            out.extend(batch.column(batch.schema.get_field_index("seq_len")).to_pylist())
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Lengths:
    train: list[int]  # tokens of each row training packs (prepare's validation rows left out)
    answer_tokens: int  # tokens of assistant answers over every row: what the loss is computed on
    source: str  # for messages: "read from the prepared dataset in ...", "estimated from ..."
    prepared: bool


def prepared(prepare_dir: Path) -> Lengths | None:
    """The training rows' lengths of a prepared dataset (None when prepare has not finished there,
    or its files cannot be read)."""
    summary, splits, dataset = prepare_dir / "summary.json", prepare_dir / "splits.json", prepare_dir / "dataset"
    if not (summary.is_file() and splits.is_file() and (dataset / "state.json").is_file()):
        return None
    try:
        out = subprocess.run(
            [sys.executable, "-c", _READ_SEQ_LEN, str(dataset)], capture_output=True, text=True, timeout=300
        )
        lengths = [int(n) for n in json.loads(out.stdout)] if out.returncode == 0 else None
        held = set(json.loads(splits.read_text()).get("validation", []))
        answers = int(json.loads(summary.read_text()).get("trainable_tokens", 0))
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    if lengths is None:
        return None
    train = [n for i, n in enumerate(lengths) if i not in held]
    return Lengths(train, answers, f"read from the prepared dataset in {dataset}", True)


def estimate(data: DataConfig, target: str | None, seed: int) -> Lengths | None:
    """The rows prepare would make of `data`, their tokens estimated (see the module's docstring);
    None when data.path holds no data file."""
    from eyas.workers.data import reader

    try:
        files = reader.data_files(data.path)
    except reader.DataError:
        return None
    count = _counter(target)
    limit = reader.row_byte_limit(data.max_length)
    lengths: list[int] = []
    answers = used = 0
    sampled = False
    try:
        for raw in reader.read_rows(files, limit):
            if data.limit and len(lengths) >= data.limit:
                break
            if used >= SAMPLE_BYTES:
                sampled = True
                break
            if raw.error is not None:
                continue
            used += len(json.dumps(raw.value, ensure_ascii=False).encode("utf-8", "surrogatepass")) + 1
            try:
                item = reader.normalize(raw.value, data.format, 1 << 31)
            except reader.RowError:
                continue
            if isinstance(item, reader.Tokens):
                n, a = len(item.input_ids), sum(1 for m in item.loss_mask[: data.max_length] if m)
            else:
                sizes = count([m["content"] for m in item.messages])
                n = sum(sizes)
                a = sum(s for s, m in zip(sizes, item.messages) if m["role"] == "assistant")
            lengths.append(max(1, min(n, data.max_length)))
            answers += min(a, data.max_length)
    except reader.DataError:
        return None
    if not lengths:
        return Lengths([], 0, f"estimated from {data.path}: no usable row", False)
    how = count.how
    if sampled:
        # The rows read stand for the rest, at their bytes per row (JSON written back: near the file's).
        total = sum(f.stat().st_size for f in files)
        rows = max(len(lengths), round(len(lengths) * total / used))
        if data.limit:
            rows = min(rows, data.limit)
        answers = round(answers * rows / len(lengths))
        # The held-out share comes off the end: which rows prepare holds out matters nothing here,
        # and its hash of every row would take seconds on millions.
        held = min(rows - 1, max(1, round(rows * data.validation_fraction))) if data.validation_fraction > 0 else 0
        train = [lengths[i % len(lengths)] for i in range(rows - held)]
        how += f", the first {SAMPLE_BYTES >> 20} MiB of rows standing for all ~{rows}"
        return Lengths(train, answers, f"estimated from {data.path}: {how}", False)
    train = trainsteps.training_lengths(lengths, data.validation_fraction, seed)
    return Lengths(train, answers, f"estimated from {data.path}: {how}", False)


def _counter(target: str | None):
    """A function from texts to their token counts, with `how` saying which it is."""
    path = Path(target) / "tokenizer.json" if target else None
    tokenizer = None
    if path is not None and path.is_file():
        try:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(path))
        except Exception:  # any failure to read it leaves the byte estimate
            tokenizer = None
    if tokenizer is not None:

        def by_tokenizer(texts: list[str]) -> list[int]:
            return [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]

        by_tokenizer.how = (
            "each turn tokenized with the target's tokenizer.json, the chat template's tokens not counted"
        )
        return by_tokenizer

    def by_bytes(texts: list[str]) -> list[int]:
        return [max(1, len(t.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN) for t in texts]

    by_bytes.how = f"each turn's text at {BYTES_PER_TOKEN} bytes a token (the target has no tokenizer.json)"
    return by_bytes


def lengths_for(cfg) -> Lengths | None:
    """What `eyas validate` counts a run's steps on: the prepared dataset under cfg.output_dir when
    prepare has run there, else the estimate from cfg.data."""
    if cfg.output_dir:
        found = prepared(Path(cfg.output_dir) / "prepare")
        if found is not None:
            return found
    if cfg.data is None:
        return None
    return estimate(cfg.data, cfg.target.path if cfg.target is not None else None, cfg.train.seed)
