"""cli/datasize.py's estimate of the rows prepare makes, on the demo's synthetic chats and its tiny
tokenizer (the comparison with the real prepare stage is tests/integration/cli/test_init_sizing.py)."""

from __future__ import annotations

import json

import pytest

from eyas.cli import datasize
from eyas.state import trainsteps
from eyas.state.inputtables import DataConfig
from eyas.workers.models import assets


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    assets.build_tokenizer(path)
    return path


def turn_tokens(tokenizer_dir, rows: list[dict]) -> list[tuple[int, int]]:
    """(all turns' tokens, the assistant turns') of each row, with the tokenizers library."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    out = []
    for row in rows:
        turns = [(t["from"], len(tok.encode(t["value"], add_special_tokens=False).ids)) for t in row["conversations"]]
        out.append((sum(n for _, n in turns), sum(n for who, n in turns if who == "gpt")))
    return out


def test_rows_are_counted_with_the_targets_tokenizer_and_the_held_out_rows_left_out(tmp_path, tokenizer_dir):
    path = assets.write_dataset(tmp_path / "chat.jsonl", n=100)  # with malformed lines, which are skipped
    found = datasize.estimate(DataConfig(path=str(path)), str(tokenizer_dir), seed=0)
    counts = turn_tokens(tokenizer_dir, assets.conversations(100))
    held = set(trainsteps.validation_rows(100, 0.05, 0))
    assert found.train == [n for i, (n, _) in enumerate(counts) if i not in held]
    assert found.answer_tokens == sum(a for _, a in counts)
    assert not found.prepared
    assert found.source == (
        f"estimated from {path}: each turn tokenized with the target's tokenizer.json, "
        "the chat template's tokens not counted"
    )


def test_without_a_tokenizer_it_is_four_bytes_a_token(tmp_path):
    path = assets.write_dataset(tmp_path / "chat.jsonl", n=40, malformed=False)
    found = datasize.estimate(DataConfig(path=str(path), validation_fraction=0), str(tmp_path), seed=0)
    expected = [
        sum(max(1, len(t["value"].encode()) // 4) for t in row["conversations"]) for row in assets.conversations(40)
    ]
    assert found.train == expected
    assert "4 bytes a token (the target has no tokenizer.json)" in found.source


def test_max_length_and_limit_cut_as_prepare_does(tmp_path, tokenizer_dir):
    path = assets.write_dataset(tmp_path / "chat.jsonl", n=50, malformed=False)
    found = datasize.estimate(
        DataConfig(path=str(path), max_length=40, limit=20, validation_fraction=0), str(tokenizer_dir), seed=0
    )
    counts = turn_tokens(tokenizer_dir, assets.conversations(50))[:20]
    assert found.train == [min(n, 40) for n, _ in counts]


def test_a_large_file_is_read_in_part_and_its_rows_repeated(tmp_path, tokenizer_dir, monkeypatch):
    path = assets.write_dataset(tmp_path / "chat.jsonl", n=400, malformed=False)
    whole = datasize.estimate(DataConfig(path=str(path)), str(tokenizer_dir), seed=0)
    monkeypatch.setattr(datasize, "SAMPLE_BYTES", path.stat().st_size // 8)
    part = datasize.estimate(DataConfig(path=str(path)), str(tokenizer_dir), seed=0)
    assert "of rows standing for all ~" in part.source
    assert abs(len(part.train) - len(whole.train)) <= 0.05 * len(whole.train)
    assert abs(sum(part.train) - sum(whole.train)) <= 0.15 * sum(whole.train)


def test_no_data_file_no_estimate(tmp_path):
    assert datasize.estimate(DataConfig(path=str(tmp_path / "missing.jsonl")), None, seed=0) is None


def test_a_prepared_dataset_is_read_in_a_child_process(tmp_path):
    """The arrow file as prepare writes it (datasets' save_to_disk), its splits and summary."""
    import datasets

    prep = tmp_path / "prepare"
    rows = [[1] * n for n in (5, 9, 3, 7)]
    datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": rows, "seq_len": [len(r) for r in rows]}).save_to_disk(
        str(prep / "dataset")
    )
    (prep / "splits.json").write_text(json.dumps({"validation": [1]}))
    assert datasize.prepared(prep) is None  # no summary.json yet: prepare has not finished
    (prep / "summary.json").write_text(json.dumps({"trainable_tokens": 24}))
    found = datasize.prepared(prep)
    assert (found.train, found.answer_tokens, found.prepared) == ([5, 3, 7], 24, True)
    assert found.source == f"read from the prepared dataset in {prep / 'dataset'}"
