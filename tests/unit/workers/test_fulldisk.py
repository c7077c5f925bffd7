"""A rank's writes on a full disk (workers/runtime/fulldisk.py, atomic.py, progress.py): a record
written through its reserved blocks lands whole where an ordinary write fails, one too large
keeps the end of its traceback, and every failed write names its file. The full disk is a real
one: a small tmpfs, filled to its last byte."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess

import pytest

from eyas.workers.runtime import atomic, fulldisk, rank
from eyas.workers.runtime.progress import ProgressWriter


@pytest.fixture
def disk(tmp_path):
    """A 1 MiB tmpfs at tmp_path/disk."""
    path = tmp_path / "disk"
    path.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here (needs root): {out.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        shutil.rmtree(path, ignore_errors=True)


def _fill(path) -> None:
    """Write a filler until the file system refuses: not one block is left."""
    with open(path / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def test_a_held_reserve_writes_its_record_whole_where_an_atomic_write_fails(disk):
    target = disk / "rank-0.error.json"
    reserve = fulldisk.Reserve(target)
    assert reserve.hold() and reserve.held
    _fill(disk)
    with pytest.raises(OSError) as refused:
        atomic.write_json(disk / "other.json", {"x": 1})
    # os.write names no file: the atomic write says which one it could not write.
    assert (refused.value.errno, refused.value.filename) == (errno.ENOSPC, str(disk / "other.json"))
    data = json.dumps({"type": "OSError", "traceback": "t" * 20_000}).encode()
    reserve.write(data)
    assert target.read_bytes() == data and not reserve.held
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "rank-0.error.json"]  # no temp, no reserve


def test_an_error_record_larger_than_the_reserve_keeps_the_end_of_its_traceback(disk):
    path = disk / "rank-0.error.json"
    reserve = fulldisk.Reserve(path, size=16 * 1024)
    assert reserve.hold()
    _fill(disk)
    last = "OSError: [Errno 28] No space left on device: '/x/rank-0.log'"
    tb = "Traceback (most recent call last):\n" + "".join(f'  File "f{i}.py", line {i}, in g\n' for i in range(4000))
    record = {"type": "OSError", "message": "m", "traceback": tb + last + "\n", "pid": 1}
    rank.write_error(path, record, reserve)
    written = json.loads(path.read_text())
    assert path.stat().st_size <= 16 * 1024
    assert written["traceback"].endswith("line 3999, in g\n" + last + "\n")
    cut = len(record["traceback"]) - len(written["traceback"].partition("\n")[2])
    assert written["traceback"].startswith(f"[the first {cut} characters of this traceback were cut"), written
    assert {k: v for k, v in written.items() if k != "traceback"} == {"type": "OSError", "message": "m", "pid": 1}


def test_a_failed_progress_write_names_the_progress_file(disk):
    writer = ProgressWriter(disk / "rank-0.progress.jsonl", min_interval=0)
    writer.update(samples=1, force=True)
    _fill(disk)
    with pytest.raises(OSError) as refused:
        for n in range(2, 1000):  # the first page's room goes first
            writer.update(samples=n, force=True, padding="p" * 200)
    assert (refused.value.errno, refused.value.filename) == (errno.ENOSPC, str(disk / "rank-0.progress.jsonl"))


def test_the_disk_full_of_an_exception_names_its_errno_and_file():
    def chained(inner: BaseException) -> BaseException:
        try:
            try:
                raise inner
            except BaseException as exc:
                raise RuntimeError("writing the shard failed") from exc
        except RuntimeError as outer:
            return outer

    assert fulldisk.disk_full(chained(OSError(errno.ENOSPC, "No space left on device", "/o/hs_3.safetensors"))) == {
        "errno": "ENOSPC",
        "file": "/o/hs_3.safetensors",
    }
    assert fulldisk.disk_full(OSError(errno.EDQUOT, "Disk quota exceeded")) == {"errno": "EDQUOT", "file": None}
    # A library's own error that only says so in its text (safetensors' Rust core).
    text = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
    assert fulldisk.disk_full(chained(ValueError(text))) == {"errno": "ENOSPC", "file": None}
    assert fulldisk.disk_full(chained(OSError(errno.EACCES, "Permission denied", "/o"))) is None
    assert fulldisk.disk_full(ValueError("no")) is None
    record = rank.error_record(chained(OSError(errno.ENOSPC, "No space", "/o/x")), rank=0, stage="s", attempt=1)
    assert record["disk_full"] == {"errno": "ENOSPC", "file": "/o/x"}
    assert "disk_full" not in rank.error_record(ValueError("no"), rank=0, stage="s", attempt=1)


def test_the_reserve_is_given_back_when_the_rank_needs_it_not(tmp_path):
    reserve = fulldisk.Reserve(tmp_path / "rank-0.error.json")
    assert reserve.hold() and (tmp_path / ".rank-0.error.json.reserve").stat().st_size == fulldisk.RESERVE_BYTES
    fulldisk.Reserve(tmp_path / "rank-0.error.json").release()  # by name: the monitor's way
    assert list(os.scandir(tmp_path)) == []
