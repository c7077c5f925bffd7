"""The daemon's 1 Hz metrics sampler: per-rank CPU, RSS and GPU memory, progress, when each rank
last wrote, roll-ups.

The daemon calls `Sampler.sample()` once a second with the ranks it supervises and writes
what comes back: `metrics` rows through `state.store.insert_metrics`, the `ranks` and
`stages` roll-ups into their tables. The sampler itself touches no database.

Progress counts are per rank: each rank writes its own cumulative samples/tokens (and its
own totals), so a stage's figures are the sums over its ranks.

Over 500 lines (one concern: turning one sample of every rank into rows): the progress-file phases and the process states joined it this session; issue 37 splits the per-rank reading from the roll-ups.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from eyas.daemon.phases import CPU_MOVE_S
from eyas.daemon.progressfile import ProgressReader
from eyas.state.procs import same_start
from eyas.workers.nvml import GpuProbe

# Record keys that identify a record rather than measure something.
_NOT_METRICS = frozenset({"time", "rank", "pid", "attempt"})
_COUNTS = ("samples", "samples_total", "tokens", "tokens_total")

_GONE = (psutil.NoSuchProcess, psutil.AccessDenied)  # ZombieProcess is a NoSuchProcess
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


class _Series:
    """A cumulative counter over time: rate over a trailing window, and mean since the first point."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.first: tuple[float, float] | None = None
        self.last: tuple[float, float] | None = None
        self.interval = 0.0  # time between the last two points: sparse writers go stale later
        # Points inside the window plus one at or before its start, the baseline of the rate.
        self.win: deque[tuple[float, float]] = deque()

    def add(self, t: float, v: float) -> None:
        if self.first is None:
            self.first = (t, v)
        if self.last is not None:
            self.interval = t - self.last[0]
        self.last = (t, v)
        self.win.append((t, v))
        while len(self.win) >= 2 and self.win[1][0] <= t - self.window_s:
            self.win.popleft()

    def rate(self, now: float) -> float | None:
        """Units per second over the last window of points; 0 once the writer has gone quiet."""
        if self.last is None or len(self.win) < 2:
            return None
        (t0, v0), (t1, v1) = self.win[0], self.last
        if t1 <= t0:
            return None
        if now - t1 > 3 * max(self.window_s, self.interval):
            return 0.0  # stalled or finished: a stale rate would hide a hang and skew the ETA
        return (v1 - v0) / (t1 - t0)

    def mean(self) -> float | None:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        return (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])


class _Progress:
    """What one rank's progress file has said so far."""

    def __init__(self, path: Path, window_s: float):
        self.path = path
        self.reader = ProgressReader(path)
        self.window_s = window_s
        self.reset()

    def reset(self) -> None:
        """Forget what the file said: it was truncated or replaced."""
        self.bad = 0
        self.counts: dict[str, float] = {}
        self.tokens = _Series(self.window_s)
        self.samples = _Series(self.window_s)
        self.gpu_mem: float | None = None  # the largest gpu_mem_bytes a progress line reported
        self.counted_at: float | None = None  # the time of the last record that was no heartbeat
        self.phase: dict | None = None  # the open phase, from its last heartbeat


def _phase_line(prog: _Progress, rec: dict, t: float) -> str | None:
    """Take a heartbeat line into `prog.phase`: "moved" when its evidence changed (or the phase
    began), "beat" when it did not, "ended" for the phase's last line, None for any other line.

    Moving evidence is the one thing of a heartbeat that shows the phase working rather than a
    thread beating (daemon/phases.py)."""
    if "heartbeat" not in rec:
        return None
    if rec.get("ended"):
        if prog.phase is not None and prog.phase["phase"] == str(rec["heartbeat"]):
            prog.phase = None
        return "ended"
    detail = rec.get("phase") if isinstance(rec.get("phase"), dict) else {}
    name = str(rec["heartbeat"])
    since = _number(detail.get("since")) or t
    evidence = detail.get("evidence")
    old = prog.phase
    before = None if old is None else old.get("evidence")
    fresh = old is None or old["phase"] != name or old["since"] != since
    if fresh:
        prog.phase = {"phase": name, "since": since, "evidence_at": since}
    prog.phase.update(
        kind=str(detail.get("kind") or "other"),
        budget=_number(detail.get("budget")),
        waits=detail.get("waits"),
        evidence=evidence,
        time=t,
    )
    return "moved" if fresh or (evidence is not None and evidence != before) else "beat"


def _title(p: psutil.Process) -> str:
    """How a process names itself: its command line (a renamed process's new name), else its comm."""
    try:
        argv = p.cmdline()
    except _GONE:
        argv = []
    if argv:
        head = os.path.basename(argv[0]) if argv[0].startswith("/") else argv[0]
        # setproctitle pads a renamed process's command line with spaces.
        return " ".join([head, *argv[1:]]).strip()[:160]
    try:
        return p.name()
    except _GONE:
        return "?"


def _created(p: psutil.Process) -> float:
    try:
        return p.create_time()
    except _GONE:
        return 0.0


def _number(value: Any) -> float | None:
    # bool is an int, and NaN/inf would land as NULL in a NOT NULL column and sink the batch.
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def last_write(ref: RankRef, prog: _Progress | None = None) -> float | None:
    """When the rank last showed life: the newest of its log's mtime, its last progress record
    that was no heartbeat, and the last move of its open phase's evidence (None before any).

    A heartbeat is not a sign of life (daemon/phases.py): a rank whose heartbeat thread beats
    while the rest of it hangs must go quiet. The files' own times, so a late sample never
    makes a quiet rank look busy. Without what the progress file said (`prog`), its mtime."""
    if prog is None:
        return newest_mtime(ref.log_path, ref.progress_path)
    times = [newest_mtime(ref.log_path), prog.counted_at, (prog.phase or {}).get("evidence_at")]
    return max((t for t in times if t is not None), default=None)


def newest_mtime(*paths: Path | None) -> float | None:
    """The newest modification time of the files that exist among `paths`; None if none does."""
    newest = None
    for path in paths:
        if path is None:
            continue
        try:
            t = os.stat(path).st_mtime
        except OSError:
            continue
        newest = t if newest is None else max(newest, t)
    return newest


def _children_map() -> dict[int, list[int]]:
    """ppid -> child pids for every process, from one scan of /proc.

    psutil's Process.children(recursive=True) rescans all of /proc on each call, once per
    rank; one scan per sample, shared by all ranks, is what keeps the sampler cheap.
    psutil keeps that scan (`_ppid_map`) private, hence the public fallback.
    """
    try:
        ppids = psutil._ppid_map()
    except (AttributeError, psutil.AccessDenied):
        ppids = {p.pid: p.info["ppid"] for p in psutil.process_iter(["ppid"])}
    children: dict[int, list[int]] = defaultdict(list)
    for pid, ppid in ppids.items():
        if ppid is not None:
            children[ppid].append(pid)
    return children


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
        self._progress: dict[Key, _Progress] = {}
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
                self._titles.pop((pid, _created(p)), None)
        for cache in (self._trees, self._progress, self._peak, self._cpu_marks):
            for key in [k for k in cache if k[0] == attempt_id]:
                gone = cache.pop(key)
                if isinstance(gone, _Progress):
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

        children = _children_map() if any(r.root_pid or self._trees.get((r.attempt_id, r.rank)) for r in ranks) else {}
        per_stage: dict[tuple[int, str], list[tuple[RankRef, _Progress | None]]] = defaultdict(list)
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
            procs = self._tree(ref, key, children, ref.exclude)
            cpu, rss, res.procs[key] = self._measure(procs, self._titles)
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
            prog = self._read_progress(ref, key, row)
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

    def _tree(
        self, ref: RankRef, key: Key, children: dict[int, list[int]], exclude: frozenset[int] = frozenset()
    ) -> dict[int, psutil.Process]:
        """The rank's live processes: its verified root, everything below it, and known orphans
        (less the `exclude`d subtrees)."""
        known = self._trees.setdefault(key, {})
        # is_running() re-checks create time, so a cached pid that was reused drops out here.
        live = {pid: p for pid, p in known.items() if pid not in exclude and p.is_running()}
        if exclude:
            # Cached descendants of an excluded process (seen before it registered) go too.
            dropped = set(exclude)
            todo = list(exclude)
            while todo:
                for child in children.get(todo.pop(), ()):
                    if child not in dropped:
                        dropped.add(child)
                        todo.append(child)
            live = {pid: p for pid, p in live.items() if pid not in dropped}
        root = ref.root_pid
        if root and root not in live:
            try:
                p = psutil.Process(root)
                created = p.create_time()
            except _GONE:
                p = None
            if p is not None and same_start(created, ref.root_create_time):
                live[root] = p
        # Walk down from every live member, not only the root: a monitor that died leaves its
        # worker (reparented to init) still running and still the rank's.
        todo = list(live)
        while todo:
            for child in children.get(todo.pop(), ()):
                if child not in live and child not in exclude:
                    try:
                        live[child] = psutil.Process(child)
                    except _GONE:
                        continue
                    todo.append(child)
        self._trees[key] = live
        return live

    @staticmethod
    def _measure(procs: dict[int, psutil.Process], titles: dict | None) -> tuple[float, int, list[dict]]:
        """Summed CPU % and RSS of the tree, and each live process's pid, create time, state
        (psutil's status name), CPU seconds and title; drops what vanished.

        RSS counts pages shared between the processes once per process: USS would not, but
        reading smaps for it costs far more than a 1 Hz sampler may spend. State and CPU times
        come from the same read of /proc/<pid>/stat as the rest (oneshot); the title (the
        command line, which vLLM's processes rename, "VLLM::EngineCore") once per name it takes.
        """
        cpu, rss, members = 0.0, 0, []
        for pid in list(procs):
            p = procs[pid]
            try:
                with p.oneshot():  # one read of /proc/<pid>/stat serves all of these
                    c = p.cpu_percent(interval=None)  # 0.0 on the first call for a process
                    m = p.memory_info().rss
                    created = p.create_time()
                    if titles is None:  # WATCH_ENV=off: the baseline's measure
                        cpu, rss = cpu + c, rss + m
                        members.append({"pid": pid, "create_time": created, "state": "?", "cpu": 0.0, "title": "?"})
                        continue
                    state = p.status()
                    times = p.cpu_times()
                    comm = p.name()
            except _GONE:
                del procs[pid]
                continue
            # Read again when the process renamed itself since (vLLM's do, after start-up).
            comm_then, title = titles.get((pid, created), (None, None))
            if title is None or comm_then != comm:
                title = _title(p)
                titles[(pid, created)] = (comm, title)
            cpu += c
            rss += m
            members.append(
                {
                    "pid": pid,
                    "create_time": created,
                    "state": state,
                    "cpu": round(times.user + times.system, 3),
                    "title": title,
                }
            )
        return cpu, rss, members

    def _read_progress(self, ref: RankRef, key: Key, row) -> _Progress | None:
        prog = self._progress.get(key)
        path = Path(ref.progress_path)
        if prog is None or prog.path != path:
            if not path.exists():
                return None
            if prog is not None:
                prog.reader.close()
            prog = self._progress[key] = _Progress(path, self.rate_window_s)
        restarts = prog.reader.restarts
        records, bad = prog.reader.read()
        counted = moved = False
        if prog.reader.restarts != restarts:  # truncated or replaced: what we knew is void
            prog.reset()
        if bad:
            if not prog.bad:
                self.log.warning("progress file %s: corrupt line skipped (the rank writes bad JSON)", prog.path)
            prog.bad += bad
        for rec in records:
            t = _number(rec.get("time"))
            if t is None:
                t = time.time()  # a record without its own time: it was written moments ago
            kind = _phase_line(prog, rec, t)
            if kind is not None:
                moved = moved or kind == "moved"
                counted = counted or kind == "ended"  # a phase that ended is work done
                continue
            counted = True
            emit = ref.metrics_since is None or t > ref.metrics_since
            for name, raw in rec.items():
                if name in _NOT_METRICS:
                    continue
                value = _number(raw)
                if value is None:
                    continue
                if emit:
                    row(name, value, t)
                if name in _COUNTS:
                    prog.counts[name] = value
                elif name == "gpu_mem_bytes":
                    prog.gpu_mem = max(prog.gpu_mem or 0, value)
            tokens, samples = _number(rec.get("tokens")), _number(rec.get("samples"))
            if tokens is not None:
                prog.tokens.add(t, tokens)
            if samples is not None:
                prog.samples.add(t, samples)
        if counted or moved:
            # The file's own time, as for the log (last_write): a rank's clock may differ.
            written = newest_mtime(path)
            if counted:
                prog.counted_at = written
            if moved and prog.phase is not None:
                prog.phase["evidence_at"] = written or prog.phase["evidence_at"]
        return prog

    def _stage(
        self, skey: tuple[int, str], members: list[tuple[RankRef, _Progress | None]], now: float, res: SampleResult
    ) -> None:
        out: dict[str, float] = {}
        peaks = [self._peak[(r.attempt_id, r.rank)] for r, _ in members if (r.attempt_id, r.rank) in self._peak]
        if peaks:
            out["peak_gpu_mem"] = float(max(peaks))
        progs = [p for _, p in members if p is not None]
        for name in _COUNTS:
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
