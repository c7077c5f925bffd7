"""The streaming window's protocol (workers/extract/stream.py) and the extractor's admission rule (workers/extract/producer.py): the stream's order and positions, and a batch let into the window only when it and every earlier missing shard fit the budget."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from rank_context import rank_context

from eyas.state import specs
from eyas.workers.extract import hswriter, producer, stream

ORDERS = [([10, 11, 12, 13, 14], [2, 5]), ([14, 13, 12, 11, 10], [3, 5]), ([12, 10, 11, 13, 14], [1, 5])]


def test_the_stream_is_validation_then_each_epoch_in_train_order(tmp_path):
    w = stream.Stream("window", 100, 1000, [1, 2], ORDERS, tmp_path)
    assert [r for _, r in w.items()] == [1, 2, *ORDERS[0][0], *ORDERS[1][0], *ORDERS[2][0]]
    # From train's checkpoint at epoch 2, step 1: validation, then the rest of that epoch on.
    assert w.items((1, 1)) == [(None, 1), (None, 2), (1, 11), (1, 10), *[(2, r) for r in ORDERS[2][0]]]
    # Train needs through the end of its step: step 0 of epoch 1 is rows 10, 11.
    assert w.needed_through(None, (0, 0)) == 4
    assert [w.needed_through((0, k), (0, 0)) for k in (0, 1)] == [4, 7]
    assert [w.needed_through((e, k), (1, 1)) for e, k in ((1, 1), (2, 0), (2, 1))] == [4, 5, 9]
    assert w.dir_for(None) == tmp_path / "hidden_states" and w.dir_for(2) == tmp_path / "window" / "epoch-2"
    # Keep mode: one pass, as offline, in hidden_states/; later epochs need nothing more.
    k = stream.Stream("keep", 100, 1000, [1, 2], ORDERS, tmp_path)
    assert [r for _, r in k.items()] == [1, 2, *ORDERS[0][0]]
    assert [k.needed_through((0, 0), (0, 0)), k.needed_through((1, 0), (0, 0))] == [4, 7]
    assert k.dir_for(2) == tmp_path / "hidden_states"


def test_epoch_orders_are_the_offline_plan_rank_by_rank_and_each_row_once():
    lengths = [5 + (i * 7) % 40 for i in range(60)]
    rows = [i for i in range(60) if i % 10]  # every 10th held out
    orders = stream.epoch_orders(lengths, rows, 120, 2, 3, 2)
    from eyas.workers.train import data as train_data

    for e, (order, ends) in enumerate(orders):
        assert sorted(order) == rows and ends[-1] == len(order)
        plans = [train_data.plan([lengths[r] for r in rows], 120, 2, r, 3, e) for r in range(2)]
        assert order[: ends[0]] == [rows[i] for p in plans for i in p[0]]
    assert orders[0][0] != orders[1][0]  # a fresh shuffle each epoch


def test_a_streaming_run_starts_vocab_before_extract():
    assert specs.stream_order(["preflight", "prepare", "extract", "vocab", "train", "evaluate"]) == [
        "preflight",
        "prepare",
        "vocab",
        "extract",
        "train",
        "evaluate",
    ]
    assert (
        specs.sibling("extract") == "train" and specs.sibling("train") == "extract" and specs.sibling("vocab") is None
    )
    cfg = {"pipeline": ["prepare", "extract", "train"], "storage": {"mode": "streaming"}}
    assert specs.streaming(cfg) and not specs.streaming({**cfg, "storage": {"mode": "offline"}})


def _producer(tmp_path: Path, budget: int, lengths, val=(0,), order=(1, 2, 3, 4, 5, 6), ends=(2, 4, 6)):
    st = stream.Stream("window", budget, 10**9, list(val), [(list(order), list(ends))], tmp_path)
    (tmp_path / "attempt").mkdir(exist_ok=True)
    ctx = rank_context("extract", tmp_path / "attempt", tmp_path, {}, progress_interval=0)
    # 1 layer id of width 1 in float32: 12 bytes a token, plus the file overhead.
    return st, producer.Producer(ctx, None, st, (0, 0), lengths, stream.token_bytes(1, 1, 4))


def _shard(st: stream.Stream, epoch, row: int, size: int) -> Path:
    """A shard of `size` bytes landing as the writer lands it: temp file, then renamed and counted."""
    d = st.dir_for(epoch)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{hswriter.file_name(row)}.1.0.tmp"
    tmp.write_bytes(b"x" * size)
    stream.Ledger(st.extract_dir).replace(tmp, d / hswriter.file_name(row))
    return d / hswriter.file_name(row)


def test_a_batch_waits_until_it_and_every_earlier_missing_shard_fit(tmp_path):
    lengths = [100] * 7
    one = 100 * 12 + stream.FILE_OVERHEAD  # a shard's estimate
    st, prod = _producer(tmp_path, budget=3 * one, lengths=lengths)
    items = st.items()
    assert [r for _, r in items] == [0, 1, 2, 3, 4, 5, 6]
    # Nothing on disk: the first three fit, the fourth would pass the budget.
    assert prod._fits(0, 1, one) and prod._fits(1, 2, one) and prod._fits(2, 3, one)
    assert not prod._fits(3, 4, one)
    # A later batch cannot take the room of an earlier missing shard (position 1, row 1).
    _shard(st, None, 0, one)
    assert prod._fits(2, 3, one)  # itself, row 1 before it, and the validation shard on disk: 3
    assert not prod._fits(3, 4, one)  # rows 1 and 2 still to come before it
    # In flight on another rank counts as used, and its rows are no longer "missing before".
    stream_dir = tmp_path / stream.STREAM_DIR
    (stream_dir / "inflight-1.json").write_text(f"[[1, 2, {one}]]")
    assert prod._fits(2, 3, one) and not prod._fits(3, 4, one)


def test_the_window_frees_as_train_moves_on_and_the_producer_then_goes(tmp_path):
    lengths = [100] * 7
    one = 100 * 12 + stream.FILE_OVERHEAD
    st, prod = _producer(tmp_path, budget=3 * one, lengths=lengths)
    for epoch, row in [(None, 0), (0, 1), (0, 2)]:
        _shard(st, epoch, row, one)
    assert not prod._fits(3, 4, one)
    done = threading.Event()

    def admit():
        prod.admit(3, 4, one, 1)
        done.set()

    t = threading.Thread(target=admit, daemon=True)
    t.start()
    time.sleep(0.3)
    assert not done.is_set() and prod.waits == 1
    # Train finished step 0 (rows 1, 2), freed them, and needs step 1 now.
    assert stream.Ledger(tmp_path).free([st.dir_for(0) / hswriter.file_name(row) for row in (1, 2)]) == 2
    stream.publish_need(tmp_path, 0, 1)
    assert done.wait(5)
    assert prod.wait_s > 0.2 and prod.in_flight == [(3, 4, one, 1)]


@pytest.mark.parametrize("keep", [True, False])
def test_the_mode_is_chosen_once_and_kept(tmp_path, keep):
    first = stream.write_plan(tmp_path, {"mode": "keep" if keep else "window", "budget": 1, "dataset_bytes": 2})
    again = stream.write_plan(tmp_path, {"mode": "window" if keep else "keep", "budget": 9, "dataset_bytes": 2})
    assert first == again and again["mode"] == ("keep" if keep else "window")


def _on_disk(root: Path) -> tuple[int, int]:
    """(bytes, files) of the finished shards under root, listed here independently of stream.py."""
    sizes = [p.stat().st_size for p in root.rglob("hs_*.safetensors")]
    return sum(sizes), len(sizes)


def test_the_ledger_counts_exactly_what_the_writer_lands_and_train_frees_and_a_crash_is_rebuilt(tmp_path):
    """The window's count (stream.Ledger) against a real listing after shards written by the real
    writer (fp8 and plain), freed by train, and a killed process's half-done work; admission
    reads the count and never lists the window."""
    import torch

    st, prod = _producer(tmp_path, budget=10**9, lengths=[100] * 7)
    ledger = stream.Ledger(tmp_path)
    assert ledger.read() == (0, 0) and ledger.rebuild(st) == 0
    for epoch, rows, dtype in ((None, [0], "target"), (0, [1, 2, 3], "fp8"), (1, [4, 5], "target")):
        w = hswriter.HiddenStatesWriter(st.dir_for(epoch), hidden_dtype=dtype, replace=ledger.replace)
        hidden = torch.randn(len(rows), 9 + len(rows), 2, 64, dtype=torch.bfloat16)
        items = [hswriter.Item(r, i, 9 + i, torch.arange(9 + i)) for i, r in enumerate(rows)]
        w.put(hswriter.Job(hidden, items))
        w.close()
    assert ledger.read() == _on_disk(tmp_path) and ledger.read()[1] == 6
    first = ledger.total()
    # Train frees step 0's shards (one already gone: a second free counts nothing).
    assert ledger.free([st.dir_for(0) / hswriter.file_name(r) for r in (1, 2)]) == 2
    assert ledger.free([st.dir_for(0) / hswriter.file_name(1)]) == 0
    assert ledger.read() == _on_disk(tmp_path) and ledger.total() < first
    # Admission reads the count, under the lock, without listing a directory.
    st.scan_bytes = lambda: pytest.fail("a batch's admission listed the window")
    assert prod._fits(len(st.items()) - 1, len(st.items()), 1) and prod.metrics()["window_bytes"] == ledger.total()
    del st.scan_bytes
    # A killed process: a shard renamed but never counted, one unlinked but never uncounted, and
    # a temp file mid-write. The count is off by both shards until extract's rank 0 rebuilds it.
    stray = st.dir_for(1) / hswriter.file_name(6)
    stray.write_bytes(b"y" * 5000)
    (st.dir_for(1) / hswriter.file_name(4)).unlink()
    (st.dir_for(1) / f".{hswriter.file_name(5)}.77.0.tmp").write_bytes(b"z" * 700)
    assert ledger.read() != _on_disk(tmp_path)
    assert ledger.rebuild(st) == _on_disk(tmp_path)[0] and ledger.read() == _on_disk(tmp_path)
    # And exact again from there on: a shard written over an older copy replaces its bytes.
    tmp = st.dir_for(1) / ".hs_6.safetensors.1.1.tmp"
    tmp.write_bytes(b"w" * 1234)
    ledger.replace(tmp, stray)
    assert ledger.read() == _on_disk(tmp_path) and stray.stat().st_size == 1234


def test_train_counts_its_wait_for_the_extractors_plan_as_a_wait_on_extract(tmp_path):
    from eyas.workers.train.feed import Feed

    prepare = tmp_path / "prepare"
    prepare.mkdir()
    (prepare / "splits.json").write_text('{"validation": [0]}')
    extract, out, attempt = tmp_path / "extract", tmp_path / "train", tmp_path / "attempt"
    attempt.mkdir()
    ctx = rank_context("train", attempt, tmp_path, {"name": "feed"}, progress_interval=0)
    lengths = [100] * 7
    plan = {"mode": "window", "budget": 10**6, "dataset_bytes": 10**7, "samples": 7}
    # The extractor is still loading its target: no plan yet, and train waits for it.
    threading.Timer(0.4, stream.write_plan, (extract, plan)).start()
    feed = Feed(ctx, extract, prepare, out, lengths)
    assert feed.stream.mode == "window"
    m = feed.metrics()
    assert m["train_waits"] == 1 and 0.3 < m["train_wait_s"] < 5, m
    # Restarted after the plan exists: no wait to count.
    assert Feed(ctx, extract, prepare, out, lengths).metrics()["train_waits"] == 0


def test_the_ledger_keeps_the_windows_peak_which_the_producer_reports_everywhere(tmp_path):
    """The peak is the most bytes the window held at once, counted as each shard lands: one a
    look before each admission misses (the last batch lands after the last look), and the
    figure both the progress metric and the summary take (producer.peak)."""
    from eyas.daemon.progressfile import read_new

    one = 100 * 12 + stream.FILE_OVERHEAD
    st, prod = _producer(tmp_path, budget=10 * one, lengths=[100] * 7)
    ledger = stream.Ledger(tmp_path)
    assert prod._fits(0, 1, one)  # a look before the admission: nothing on disk yet
    for epoch, row in [(None, 0), (0, 1), (0, 2)]:
        _shard(st, epoch, row, one)
    assert ledger.figures() == (3 * one, 3, 3 * one)
    # Train frees step 0: the window shrinks, its peak stays.
    assert ledger.free([st.dir_for(0) / hswriter.file_name(r) for r in (1, 2)]) == 2
    assert ledger.figures() == (one, 1, 3 * one)
    _shard(st, 0, 3, 2 * one)
    assert ledger.figures() == (3 * one, 2, 3 * one)
    _shard(st, 0, 4, one)
    assert ledger.peak() == 4 * one
    # A retry's rebuild counts the disk again and keeps the peak of the attempts before it.
    assert ledger.rebuild(st) == 4 * one and ledger.peak() == 4 * one
    assert ledger.free([st.dir_for(0) / hswriter.file_name(4)]) == 1 and ledger.rebuild(st) == 3 * one
    assert ledger.peak() == 4 * one
    assert prod.metrics()["window_bytes"] == 3 * one and prod.metrics()["window_peak_bytes"] == 4 * one
    # The summary's figure is the metric's last value: the same number.
    assert prod.peak() == 4 * one
    records, _, _ = read_new(tmp_path / "attempt" / "rank-0.progress.jsonl", 0)
    assert records[-1]["window_peak_bytes"] == 4 * one


def test_the_producers_in_flight_record_goes_when_it_finishes_and_stays_when_it_fails(tmp_path):
    one = 100 * 12 + stream.FILE_OVERHEAD
    st, prod = _producer(tmp_path, budget=10 * one, lengths=[100] * 7)
    mine = tmp_path / stream.STREAM_DIR / "inflight-0.json"
    prod.admit(0, 1, one, 1)
    assert json.loads(mine.read_text()) == [[0, 1, one]]
    prod.abort()  # a failed walk: the record stays, as a kill would leave it
    assert json.loads(mine.read_text()) == [[0, 1, one]]
    st, prod = _producer(tmp_path, budget=10 * one, lengths=[100] * 7)  # the retry's rank starts afresh
    assert json.loads(mine.read_text()) == []
    prod.admit(0, 1, one, 1)
    _shard(st, None, 0, one)
    prod.close()
    assert not mine.exists() and sorted(p.name for p in (tmp_path / stream.STREAM_DIR).glob("inflight-*")) == []
