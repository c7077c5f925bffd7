"""The TUI's log layer on real files: offset indexing, appends, merging by time, regex scans."""

from __future__ import annotations

import heapq
import os
import random
import threading
import time

import pytest

from eyas.tui.logindex import LogFile, parse_stamp
from eyas.tui.logmodel import MergedModel, SingleModel, Source
from eyas.tui.logsearch import ERROR_RE, Scan, compile_filter
from eyas.tui.logwatch import LogWatcher


def _indexed(path, rank=0, chunk=1 << 20) -> LogFile:
    f = LogFile(path, rank, (2026, 12, 2))
    while f.index_more(chunk):
        pass
    return f


def test_index_reads_lines_by_offset_with_appends_partial_lines_and_truncation(tmp_path):
    p = tmp_path / "rank-0.log"
    p.write_bytes(b"one\ntwo\r\n\nfour \xff\n")
    f = _indexed(p, chunk=3)  # chunks smaller than a line: lines still come out whole
    assert f.line_count() == 4 and f.complete_count() == 4
    assert f.lines(0, 10) == ["one", "two", "", "four \ufffd"]
    with open(p, "ab") as out:
        out.write(b"five\nsix-without-newline")
    f.index_more()
    assert (f.line_count(), f.complete_count()) == (6, 5)
    assert f.lines(4, 6) == ["five", "six-without-newline"]
    with open(p, "ab") as out:
        out.write(b" done\n")
    f.index_more()
    assert f.line(5) == "six-without-newline done" and f.line_count() == 6
    gen = f.generation
    p.write_bytes(b"fresh\n")  # truncated (a new file of the same name)
    f.index_more()
    assert (f.generation, f.line_count(), f.lines(0, 5)) == (gen + 1, 1, ["fresh"])


def test_a_missing_log_counts_as_empty_until_it_appears(tmp_path):
    f = LogFile(tmp_path / "rank-3.log", 3)
    assert (f.index_more(), f.line_count(), f.lines(0, 5), f.caught_up) == (0, 0, [], True)
    (tmp_path / "rank-3.log").write_text("hello\n")
    assert f.index_more() == 6 and f.lines(0, 1) == ["hello"]


def test_a_huge_line_is_cut_for_display(tmp_path):
    p = tmp_path / "rank-0.log"
    p.write_bytes(b"x" * 200_000 + b"\nshort\n")
    f = _indexed(p)
    first, second = f.lines(0, 2)
    assert first.endswith(" …") and len(first) == 64 * 1024 + 2 and second == "short"


def test_stamps_python_logging_iso_and_vllm_and_inherited_by_unstamped_lines(tmp_path):
    assert parse_stamp("2026-12-02 13:05:01,123 INFO x: y", "2026", "12-02") == "2026-12-02 13:05:01.123000"
    assert parse_stamp("2026-12-02T13:05:01.5 y", "2026", "12-02") == "2026-12-02 13:05:01.500000"
    assert (
        parse_stamp("(EngineCore pid=7) INFO 01-03 00:00:02 [core.py:1] up", "2026", "12-31")
        == "2027-01-03 00:00:02.000000"
    )
    assert parse_stamp("  File x, line 3", "2026", "12-02") is None
    p = tmp_path / "rank-0.log"
    lines = (
        ["preamble"]
        + ["2026-12-02 13:00:00,000 ERROR x: boom", "Traceback (most recent call last):"]
        + [f"  frame {i}" for i in range(700)]
        + ["2026-12-02 13:00:05,000 INFO x: after"]
    )
    p.write_text("\n".join(lines) + "\n")
    f = _indexed(p)
    assert f.stamp(0) == ""  # before any stamp: sorts first
    assert f.stamp(2) == f.stamp(650) == "2026-12-02 13:00:00.000000"  # across blocks, via checkpoints
    assert f.stamp(len(lines) - 1) == "2026-12-02 13:00:05.000000"


def _random_logs(tmp_path, ranks=4, lines=2500, seed=7):
    rng = random.Random(seed)
    files = []
    for r in range(ranks):
        t, out = 0, []
        for i in range(lines):
            t += rng.choice([0, 0, 1, 2, 5])
            if rng.random() < 0.2:
                out.append(f"  continuation of r{r} line {i}")
            else:
                out.append(f"2026-12-02 {t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d},000 INFO x: r{r} line {i}")
        (tmp_path / f"rank-{r}.log").write_text("\n".join(out) + "\n")
        files.append(_indexed(tmp_path / f"rank-{r}.log", r, chunk=4096))
    return files


def test_merged_view_equals_a_full_merge_at_every_position_without_building_one(tmp_path):
    files = _random_logs(tmp_path)
    expected = list(heapq.merge(*[[(f.stamp(i), f.rank, i) for i in range(f.line_count())] for f in files]))
    model = MergedModel([Source(f) for f in files])
    assert model.total() == len(expected) == 10_000
    for row in (0, 1, 17, 999, 5000, 7777, 9990, 9999, 10_000):
        model._cache = None  # a jump: found by selection
        got = model.rows(row, 12)
        assert [(r.rank, r.line) for r in got] == [(e[1], e[2]) for e in expected[row : row + 12]], row
    for row in range(0, 10_000, 613):  # neighbouring positions: found by stepping
        got = model.rows(row, 5)
        assert [(r.rank, r.line) for r in got] == [(e[1], e[2]) for e in expected[row : row + 5]], row
    assert all(model.row_of(e[1], e[2]) == k for k, e in list(enumerate(expected))[::101])
    assert model.rows(42, 1)[0].text == files[expected[42][1]].line(expected[42][2])


def test_filter_scan_keeps_matching_lines_and_merges_them(tmp_path):
    files = _random_logs(tmp_path, ranks=3, lines=1500)
    pattern = compile_filter(r"line \d*7\b")
    scans = [Scan(f, pattern) for f in files]
    for s in scans:
        while s.step(max_bytes=3000):  # many small steps: as the watcher runs them
            pass
    for f, s in zip(files, scans):
        assert list(s.matches) == [i for i in range(f.line_count()) if pattern.search(f.line(i))]
        assert s.done
    single = SingleModel(Source(files[1], scans[1]))
    assert [r.line for r in single.rows(0, 1000)] == list(scans[1].matches)
    merged = MergedModel([Source(f, s) for f, s in zip(files, scans)])
    everything = heapq.merge(*[[(f.stamp(i), f.rank, i) for i in s.matches] for f, s in zip(files, scans)])
    assert [(r.rank, r.line) for r in merged.rows(0, 10_000)] == [(e[1], e[2]) for e in everything]
    with pytest.raises(ValueError, match=r"filter '\(' is not a regular expression .*escape"):
        compile_filter("(")


def test_first_error_scan_stops_at_the_first_error_line(tmp_path):
    p = tmp_path / "rank-0.log"
    p.write_text(
        "ok\nstill ok\nINFO warming\nTraceback (most recent call last):\n  File x\nValueError: bad\nERROR later\n"
    )
    f = _indexed(p)
    scan = Scan(f, ERROR_RE, first_only=True)
    while scan.step():
        pass
    assert (scan.first, scan.done) == (3, True)


def test_watcher_indexes_in_a_thread_and_follows_appends(tmp_path):
    p = tmp_path / "rank-0.log"
    p.write_text("".join(f"line {i}\n" for i in range(50_000)))
    f = LogFile(p, 0)
    w = LogWatcher([f], poll=0.02)
    w.start()
    try:
        deadline = time.monotonic() + 20
        while not f.caught_up and time.monotonic() < deadline:
            time.sleep(0.01)
        assert f.line_count() == 50_000
        seen = w.version
        with open(p, "a") as out:
            out.write("appended\n")
        while f.line_count() < 50_001 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert f.line(50_000) == "appended" and w.version > seen
    finally:
        w.stop()
        w.join(5)
    assert not w.is_alive() and w.error is None


def test_readers_see_consistent_lines_while_the_index_grows(tmp_path):
    """The UI thread reads while the watcher thread extends the index: no torn lines."""
    p = tmp_path / "rank-0.log"
    p.write_text("")
    f = LogFile(p, 0)
    stop = threading.Event()

    def writer():
        with open(p, "a") as out:
            for i in range(20_000):
                out.write(f"row {i:06d}\n")
                if i % 500 == 0:
                    out.flush()
                    os.fsync(out.fileno())
        stop.set()

    t = threading.Thread(target=writer)
    t.start()
    bad = []
    while not stop.is_set() or f.behind:
        f.index_more(8192)
        n = f.complete_count()
        for line in f.lines(max(0, n - 20), n):
            if not (len(line) == 10 and line.startswith("row ")):
                bad.append(line)
    t.join()
    assert bad == [] and f.line_count() == 20_000
