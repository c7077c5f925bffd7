"""The disk a streaming run's hidden states take, as the streaming tests and bench_stream measure it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def hs_bytes(extract_dir: Path) -> int:
    """Every hidden-state file under extract/ (temp files included), as the disk sees them."""
    total = 0
    for dirpath, _, files in os.walk(extract_dir):
        for f in files:
            if f.endswith((".safetensors", ".tmp")):
                try:
                    total += os.path.getsize(os.path.join(dirpath, f))
                except FileNotFoundError:  # freed by the trainer between the listing and the stat
                    continue
    return total


class DiskSampler:
    """The hidden-state directory's size, sampled every 20 ms while a run goes on."""

    def __init__(self, extract_dir: Path):
        self.dir, self.peak, self.samples = extract_dir, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, hs_bytes(self.dir))
            self.samples += 1
            time.sleep(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak
