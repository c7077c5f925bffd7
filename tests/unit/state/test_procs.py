"""One process-identity rule for the daemon's re-adoption, its sampler and the TUI."""

from __future__ import annotations

import subprocess
import time

import psutil

from eyas.state import procs
from eyas.tui.procs import ProcWatch


def test_a_clock_step_does_not_lose_a_live_process_but_a_recycled_pid_is_another():
    child = subprocess.Popen(["sleep", "30"])
    try:
        created = psutil.Process(child.pid).create_time()
        # Half a second off: what psutil reads for the same process after the wall clock
        # stepped. The daemon used to demand 0.01 s and dropped such a rank on re-adoption.
        assert procs.alive(child.pid, created + 0.5)
        assert procs.alive(child.pid, created - 0.5)
        # Minutes off: another process that got the same pid.
        assert not procs.alive(child.pid, created + 120)
        # The TUI reads a rank's tree by the same rule.
        grand = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
        try:
            watch = ProcWatch()
            for _ in range(100):  # until the shell has started its sleep
                if psutil.Process(grand.pid).children():
                    break
                time.sleep(0.02)
            assert watch.descendants(grand.pid, psutil.Process(grand.pid).create_time() + 0.5)
            assert watch.descendants(grand.pid, psutil.Process(grand.pid).create_time() + 120) == []
        finally:
            grand.kill()
            grand.wait()
    finally:
        child.kill()
        child.wait()
    assert not procs.alive(child.pid, created)
