"""The daemon's 1 Hz metrics sampler: per-rank CPU, RSS and GPU memory, progress, when each rank
last wrote, roll-ups.

The daemon calls `Sampler.sample()` once a second with the ranks it supervises and writes
what comes back: `metrics` rows through `state.store.insert_metrics`, the `ranks` and
`stages` roll-ups into their tables. The sampler itself touches no database.

Progress counts are per rank: each rank writes its own cumulative samples/tokens (and its
own totals), so a stage's figures are the sums over its ranks.

Of each rank it reads two things, each in a module of its own: its process tree
(daemon/proctree.py) and its progress file (daemon/rankprogress.py); here they become metric
rows, the ranks' roll-ups and their stages'.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from eyas.daemon.phases import CPU_MOVE_S
from eyas.daemon.proctree import children_map, created, live_tree, measure
from eyas.daemon.rankprogress import COUNTS, RankProgress, last_write, read_progress
from eyas.workers.nvml import GpuProbe

# "off": measure as before the watchdog read processes' states (no state, CPU times or title per
# process). Only tests/bench/bench_daemon_overhead.py sets it, for its baseline in the same run;
# the watchdog's process and phase rules see nothing then.
WATCH_ENV = "EYAS_WATCH"

Key = tuple[int, int]  # (attempt_id, rank)


@dataclass(frozen=True)
class RankRef:
    """One rank the daemon wants measured."""

    run_id: int
    stage: str
    attempt: int  # the attempt's number within the stage
    attempt_id: int  # the attempts table's id
    rank: int
    root_pid: int | None  # the rank's monitor process (session leader); None before it starts
    root_create_time: float | None  # psutil create_time of root_pid: guards against pid reuse
    progress_path: Path
    # Records at or before this time still feed rates and totals but give no metric rows:
    # a restarted daemon re-reads a progress file whose older rows the store already holds.
    metrics_since: float | None = None
    # Processes (and their subtrees) that are measured as ranks of their own: a vLLM
    # driver's tensor-parallel workers live in its tree but are sampled apart.
    exclude: frozenset[int] = frozenset()
    # The rank's log: with the progress file, what says when it last wrote anything.
    log_path: Path | None = None


@dataclass
class SampleResult:
    metrics: list[dict]  # rows for insert_metrics: time, run_id, stage, attempt, rank, name, value
    ranks: dict[Key, dict]  # roll-up columns of the ranks table: cpu_percent, rss, peak_gpu_mem, tok_s
    stages: dict[tuple[int, str], dict]  # (run_id, stage) -> tok_s, peak_gpu_mem, eta_s, progress, counts
    gpus: list[dict]  # GpuProbe.devices() snapshot
    descendants: dict[Key, list[tuple[int, float]]]  # the rank's live process tree, root included
    bad_lines: dict[Key, int] = field(default_factory=dict)  # corrupt progress lines so far, if any
    writes: dict[Key, float] = field(default_factory=dict)  # when each rank last showed life (last_write)
    # Every live process of the rank's tree: {"pid", "create_time", "state", "cpu", "title"}
    # (psutil's status names, CPU seconds user+system), for the watchdog (daemon/phases.py).
    procs: dict[Key, list[dict]] = field(default_factory=dict)
    # The rank's open phase (its last heartbeat's, workers/runtime/progress.py): {"phase", "kind",
    # "since", "budget", "evidence", "waits", "time", "evidence_at"}; absent when none is open.
    phases: dict[Key, dict] = field(default_factory=dict)


class Sampler:
    """Measures ranks. Keeps psutil.Process objects and file offsets between calls."""

    def __init__(self, nvml: Any = None, log: logging.Logger | None = None, rate_window_s: float = 10.0):
        self.log = log or logging.getLogger(__name__)
        self.rate_window_s = rate_window_s
        self.gpu = GpuProbe(nvml, self.log)  # nvml=None: load_nvml() (a fake, pynvml, or nothing)
        self.gpu_available: bool = self.gpu.start()
        # Cached Process objects: cpu_percent(interval=None) measures since the previous call
        # on the same object, and the cache also keeps orphans whose monitor has died.
        self._trees: dict[Key, dict[int, psutil.Process]] = {}
        self._progress: dict[Key, RankProgress] = {}
        self._peak: dict[Key, int] = {}
        self._cpu_marks: dict[Key, tuple[float, float | None]] = {}  # (tree CPU s, when it last moved)
        # (pid, create_time) -> (its comm, its command line), read again when its comm changes.
        self._titles: dict[tuple[int, float], tuple[str, str]] | None = (
            None if os.environ.get(WATCH_ENV) == "off" else {}
        )

    @property
    def watching(self) -> bool:
        """Whether processes' states, CPU times and titles are read (WATCH_ENV is not "off")."""
        return self._titles is not None

    def forget(self, attempt_id: int) -> None:
        """Drop everything kept for an attempt's ranks (call when its group has ended)."""
        for pid, p in [(pid, p) for k, tree in self._trees.items() if k[0] == attempt_id for pid, p in tree.items()]:
            if self._titles is not None:
                self._titles.pop((pid, created(p)), None)
        for cache in (self._trees, self._progress, self._peak, self._cpu_marks):
            for key in [k for k in cache if k[0] == attempt_id]:
                gone = cache.pop(key)
                if isinstance(gone, RankProgress):
                    gone.reader.close()

    def close(self) -> None:
        self.gpu.shutdown()
        self.gpu_available = False

    # --- one sample

    def sample(self, ranks: list[RankRef], now: float | None = None) -> SampleResult:
        now = time.time() if now is None else now
        res = SampleResult(metrics=[], ranks={}, stages={}, gpus=[], descendants={})
        gpu_mem: dict[int, int] = {}
        if self.gpu_available:
            res.gpus = self.gpu.devices()
            gpu_mem = self.gpu.process_gpu_memory()
            for d in res.gpus:
                for name, value in (
                    ("mem_used", d["mem_used"]),
                    ("mem_total", d["mem_total"]),
                    ("util", d["util_gpu"]),
                ):
                    if value is not None:
                        res.metrics.append(
                            {
                                "time": now,
                                "run_id": None,
                                "stage": None,
                                "attempt": None,
                                "rank": None,
                                "name": f"gpu{d['index']}.{name}",
                                "value": float(value),
                            }
                        )

        children = children_map() if any(r.root_pid or self._trees.get((r.attempt_id, r.rank)) for r in ranks) else {}
        per_stage: dict[tuple[int, str], list[tuple[RankRef, RankProgress | None]]] = defaultdict(list)
        for ref in ranks:
            key = (ref.attempt_id, ref.rank)

            def row(name: str, value: float, t: float = now, ref: RankRef = ref) -> None:
                res.metrics.append(
                    {
                        "time": t,
                        "run_id": ref.run_id,
                        "stage": ref.stage,
                        "attempt": ref.attempt,
                        "rank": ref.rank,
                        "name": name,
                        "value": float(value),
                    }
                )

            roll: dict[str, float] = {}
            procs = live_tree(self._trees, ref, key, children, ref.exclude)
            cpu, rss, res.procs[key] = measure(procs, self._titles)
            res.descendants[key] = [(p["pid"], p["create_time"]) for p in res.procs[key]]
            if procs:
                roll.update(cpu_percent=cpu, rss=float(rss))
                row("cpu_percent", cpu)
                row("rss_bytes", rss)
                if self.gpu_available:
                    # NVML reports host pids: inside a container without the host pid namespace
                    # they match nothing and GPU memory reads 0 (nvitop has the same limit).
                    used = sum(gpu_mem.get(pid, 0) for pid in procs)
                    self._peak[key] = max(self._peak.get(key, 0), used)
                    row("gpu_mem_bytes", used)
            prog = read_progress(self._progress, ref, key, row, self.rate_window_s, self.log)
            wrote = last_write(ref, prog)
            if prog is not None and prog.phase is not None and self.watching:
                # Inside a phase, the CPU of the rank's own processes is a sign of life too
                # (daemon/phases.py): a load in an engine child writes nothing the rank counts.
                tree_cpu = sum(p["cpu"] for p in res.procs[key])
                mark = self._cpu_marks.get(key)
                if mark is None or tree_cpu < mark[0] or tree_cpu - mark[0] >= CPU_MOVE_S:
                    self._cpu_marks[key] = mark = (tree_cpu, now if mark is not None else None)
                if mark[1] is not None:
                    wrote = max(wrote or mark[1], mark[1])
            if wrote is not None:
                res.writes[key] = wrote
            if prog is not None and prog.phase is not None:
                res.phases[key] = dict(prog.phase)
            if prog is not None:
                rate = prog.tokens.rate(now)
                if rate is not None:
                    row("tok_s", rate)
                mean = prog.tokens.mean()
                if mean is not None:
                    roll["tok_s"] = mean
                if prog.bad:
                    res.bad_lines[key] = prog.bad
                if prog.gpu_mem is not None:  # a Slurm rank's, taken on its node (workers/runtime/node_gpu.py)
                    self._peak[key] = max(self._peak.get(key, 0), int(prog.gpu_mem))
            if key in self._peak:
                roll["peak_gpu_mem"] = float(self._peak[key])
            if roll:
                res.ranks[key] = roll
            per_stage[(ref.run_id, ref.stage)].append((ref, prog))

        for skey, members in per_stage.items():
            self._stage(skey, members, now, res)
        return res

    def _stage(
        self, skey: tuple[int, str], members: list[tuple[RankRef, RankProgress | None]], now: float, res: SampleResult
    ) -> None:
        out: dict[str, float] = {}
        peaks = [self._peak[(r.attempt_id, r.rank)] for r, _ in members if (r.attempt_id, r.rank) in self._peak]
        if peaks:
            out["peak_gpu_mem"] = float(max(peaks))
        progs = [p for _, p in members if p is not None]
        for name in COUNTS:
            have = [p.counts[name] for p in progs if name in p.counts]
            if have:
                out[name] = sum(have)

        def rate_and_left(unit: str) -> tuple[float | None, float | None]:
            rates = [r for r in (getattr(p, unit).rate(now) for p in progs) if r is not None]
            left = [
                p.counts[f"{unit}_total"] - p.counts[unit]
                for p in progs
                if unit in p.counts and f"{unit}_total" in p.counts
            ]
            return (sum(rates) if rates else None), (max(sum(left), 0.0) if left else None)

        tok_rate, tok_left = rate_and_left("tokens")
        smp_rate, smp_left = rate_and_left("samples")
        if tok_rate is not None:
            out["tok_s"] = tok_rate
        # Tokens when the ranks count them, else samples; unknown (omitted) without a rate.
        rate, left = (tok_rate, tok_left) if tok_left is not None else (smp_rate, smp_left)
        if left is not None and (left == 0 or (rate or 0) > 0):
            out["eta_s"] = left / rate if left else 0.0
        for unit in ("tokens", "samples"):
            total = out.get(f"{unit}_total")
            if total and unit in out:
                out["progress"] = min(max(out[unit] / total, 0.0), 1.0)
                break
        if not out:
            return
        res.stages[skey] = out
        attempt = max(r.attempt for r, _ in members)
        for name in ("tok_s", "eta_s", "progress"):
            if name in out:
                res.metrics.append(
                    {
                        "time": now,
                        "run_id": skey[0],
                        "stage": skey[1],
                        "attempt": attempt,
                        "rank": None,
                        "name": name,
                        "value": out[name],
                    }
                )
