"""A Slurm rank's processes, watched on its own node: the rank monitor reports every process under
the rank (state, how long in it, CPU, title) in `rank-<r>.tree.json`, and on SIGUSR1 their native
stacks in `rank-<r>.native.json`, for the daemon's watchdog on another host.

A local rank needs none of this: the daemon reads /proc itself (daemon/sampler.py, daemon/
phases.py) and runs py-spy there (daemon/native.py). A Slurm rank's pids mean nothing on the
daemon's host, so what the watchdog needs is taken where they do, and written to the attempt
directory every node and the daemon share. Times cross hosts as durations ("for": seconds in the
state when written), never as one host's clock read on another.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from eyas.workers.runtime import atomic

INTERVAL_S = 2.0
# Seconds py-spy may take per process (a process with torch loaded has large symbol tables).
PY_SPY_TIMEOUT_S = 20.0


class NodeTree(threading.Thread):
    """Every `interval` s: the tree of `root` (the rank) and the monitor itself into `tree_path`;
    when asked (ask_native, from the monitor's SIGUSR1 handler), py-spy's dumps into `native_path`."""

    def __init__(self, root: int, tree_path: Path, native_path: Path, interval: float = INTERVAL_S):
        super().__init__(name="eyas-node-tree", daemon=True)
        self.root, self.tree_path, self.native_path, self.interval = root, tree_path, native_path, interval
        self.asked = threading.Event()
        self._since: dict[tuple[int, float], tuple[str, float]] = {}  # (pid, created) -> (state, since)

    def ask_native(self, *_signal) -> None:
        """Signal-handler safe: only sets an event the thread acts on."""
        self.asked.set()

    def run(self) -> None:
        while True:
            try:
                procs = self.snapshot()
                atomic.write_json(self.tree_path, {"time": time.time(), "procs": procs})
                if self.asked.is_set():
                    self.asked.clear()
                    atomic.write_json(self.native_path, {"time": time.time(), "dumps": native_dumps(procs)})
            except (OSError, psutil.Error):
                pass  # a full disk or a vanished root: the next look may do better
            self.asked.wait(self.interval)

    def snapshot(self) -> list[dict]:
        """The rank's process and all below it: pid, create_time, state, for (seconds in that
        state, as this monitor saw it), cpu seconds, title."""
        now = time.time()
        try:
            root = psutil.Process(self.root)
            members = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        out, seen = [], set()
        for p in members:
            try:
                with p.oneshot():
                    created, state, times = p.create_time(), p.status(), p.cpu_times()
                    argv = p.cmdline() or [p.name()]
            except psutil.Error:
                continue
            key = (p.pid, created)
            seen.add(key)
            was, since = self._since.get(key, (None, now))
            if was != state:
                since = now
            self._since[key] = (state, since)
            head = os.path.basename(argv[0]) if argv[0].startswith("/") else argv[0]
            out.append(
                {
                    "pid": p.pid,
                    "create_time": created,
                    "state": state,
                    "for": round(now - since, 3),
                    "cpu": round(times.user + times.system, 3),
                    "title": " ".join([head, *argv[1:]]).strip()[:160],  # setproctitle pads it
                }
            )
        self._since = {k: v for k, v in self._since.items() if k in seen}
        return out


def py_spy() -> str | None:
    """The py-spy beside this interpreter, else PATH's (as the daemon looks for it)."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def native_dumps(procs: list[dict]) -> dict[str, dict]:
    """pid (as text) -> {"native": py-spy's dump} or {"native_skipped": why there is none}."""
    exe = py_spy()
    out: dict[str, dict] = {}
    for p in procs:
        pid = str(p["pid"])
        if p["state"] in ("stopped", "tracing-stop"):
            out[pid] = {"native_skipped": "it is stopped: no stacks can be taken until it is continued (kill -CONT)"}
            continue
        if exe is None:
            out[pid] = {"native_skipped": "py-spy is not installed on its node"}
            continue
        try:
            done = subprocess.run(
                [exe, "dump", "--native", "--pid", pid],
                capture_output=True,
                text=True,
                timeout=PY_SPY_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            out[pid] = {"native_skipped": f"py-spy: {exc}"}
            continue
        text = done.stdout.strip()
        if done.returncode == 0 and text:
            out[pid] = {"native": text}
        else:
            why = next((s.strip() for s in (done.stderr or text).splitlines() if s.strip()), "no output")
            out[pid] = {"native_skipped": f"py-spy could not dump pid {pid}: {why[:300]}"}
    return out
