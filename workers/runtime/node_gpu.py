"""A Slurm rank's GPU memory, read on its own node: the rank monitor samples NVML for the rank's process tree and appends it to the rank's progress file, where the daemon, on another host, reads it as it reads any progress metric.

A local rank needs none of this: the daemon's sampler reads NVML for its processes itself
(daemon/sampler.py). A Slurm rank's pids mean nothing on the daemon's host, so the figure is
taken where they do. One line `{"time", "gpu_mem_bytes"}` is written when the figure changes,
with one write() on an O_APPEND descriptor (the rank's own lines stay whole beside it).
Without NVML on the node (no driver, no pynvml) the thread ends at once and nothing is written.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import psutil

INTERVAL_S = 2.0
METRIC = "gpu_mem_bytes"


class NodeGpuMemory(threading.Thread):
    """Samples the GPU memory of `pid`'s process tree every `interval` seconds into `progress`."""

    def __init__(self, pid: int, progress: Path, interval: float = INTERVAL_S):
        super().__init__(name="eyas-node-gpu", daemon=True)
        self.pid, self.progress, self.interval = pid, progress, interval

    def run(self) -> None:
        from eyas.workers.nvml import GpuProbe  # only where it runs: NVML is no start-up cost

        probe = GpuProbe(log=logging.getLogger("eyas.node_gpu"))
        if not probe.start() or not probe.device_count():
            return
        last = None
        while True:
            try:
                root = psutil.Process(self.pid)
                pids = {self.pid} | {c.pid for c in root.children(recursive=True)}
            except psutil.Error:
                return  # the rank ended
            used = sum(probe.process_gpu_memory().get(p, 0) for p in pids)
            if used != last:
                last = used
                self._append({"time": time.time(), METRIC: used})
            time.sleep(self.interval)

    def _append(self, record: dict) -> None:
        line = (json.dumps(record) + "\n").encode()
        try:
            fd = os.open(self.progress, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            return
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
