"""A rank whose disk fills up under it, with real processes and no daemon: its error file still
lands, names the file it could not write and holds the exception's own traceback; the monitor's
exit record lands too, and no reserved blocks are left behind. The attempt directory is a small
tmpfs that the test fills, as the daemon's full-disk test does with the state directory."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
from rank_harness import start_rank, wait_for  # noqa: F401 (start_rank: fixture)

SIZE_MB = 4
# Left free once the rank runs: its flood (about 0.6 MB/s) fills it within a second.
LEFT = 256 << 10


@pytest.fixture
def small_runs(tmp_path):
    """tmp_path/runs, where start_rank makes its attempt directories, on a SIZE_MB tmpfs."""
    runs = tmp_path / "runs"
    runs.mkdir()
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE_MB}m", "tmpfs", str(runs)], capture_output=True, text=True
    )
    if out.returncode != 0:
        pytest.skip(f"mounting a {SIZE_MB} MB tmpfs is not permitted here (needs root): {out.stderr.strip()}")
    try:
        yield runs
    finally:
        if subprocess.run(["umount", str(runs)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(runs)], capture_output=True)
        shutil.rmtree(runs, ignore_errors=True)


def _fill(path, leave: int) -> None:
    st = os.statvfs(path)
    with open(path / "filler", "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))


def test_a_rank_that_fills_the_disk_records_the_file_it_could_not_write_and_its_own_traceback(small_runs, start_rank):
    r = start_rank({"lines_per_sec": 20000, "duration": 60, "step_time": 0.05})
    r.proc_json()  # the monitor and the rank are up: both hold their records' blocks
    wait_for(lambda: r.progress(), "the rank's first progress line")
    _fill(small_runs, LEFT)
    assert r.wait() == 1
    log = str(r.file("log"))
    error = r.json("error.json")
    oserror = f"OSError: [Errno 28] No space left on device: '{log}'"
    # The file it could not write: its log (stdout), named though a descriptor names no file.
    assert error["disk_full"] == {"errno": "ENOSPC", "file": log}
    assert (error["type"], error["message"]) == ("OSError", f"[Errno 28] No space left on device: '{log}'")
    # The exception's own traceback, as raised: the writer's frame and the OSError, no log lines.
    tb = error["traceback"]
    assert tb.startswith("Traceback (most recent call last):\n") and tb.rstrip("\n").endswith(oserror), tb
    assert re.search(r'selftest\.py", line \d+, in _flood\n\s+sys\.stdout\.write\(', tb), tb
    assert not re.search(r"^r0 line \d+", tb, re.M), tb
    assert error["pid"] == r.json("proc.json")["pid"]
    # The monitor's exit record landed too, and nothing reserved is left.
    assert r.json("exit.json")["exit_code"] == 1
    assert sorted(p.name for p in r.attempt_dir.glob(".*")) == []
    assert os.statvfs(small_runs).f_bavail * os.statvfs(small_runs).f_frsize < LEFT  # the disk was full
