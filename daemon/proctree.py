"""Each rank's live process tree, found from one scan of /proc per sample, and what the sampler measures of it: summed CPU % and RSS, and each process's state, CPU seconds and title.

The sampler (daemon/sampler.py) keeps the psutil.Process objects between samples:
cpu_percent(interval=None) measures since the previous call on the same object, and the cache
also keeps orphans whose monitor has died.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import TYPE_CHECKING

import psutil

from eyas.state.procs import same_start

if TYPE_CHECKING:
    from eyas.daemon.sampler import Key, RankRef

GONE = (psutil.NoSuchProcess, psutil.AccessDenied)  # ZombieProcess is a NoSuchProcess


def _title(p: psutil.Process) -> str:
    """How a process names itself: its command line (a renamed process's new name), else its comm."""
    try:
        argv = p.cmdline()
    except GONE:
        argv = []
    if argv:
        head = os.path.basename(argv[0]) if argv[0].startswith("/") else argv[0]
        # setproctitle pads a renamed process's command line with spaces.
        return " ".join([head, *argv[1:]]).strip()[:160]
    try:
        return p.name()
    except GONE:
        return "?"


def created(p: psutil.Process) -> float:
    """The process's create time; 0.0 once it is gone."""
    try:
        return p.create_time()
    except GONE:
        return 0.0


def children_map() -> dict[int, list[int]]:
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


def live_tree(
    trees: dict[Key, dict[int, psutil.Process]],
    ref: RankRef,
    key: Key,
    children: dict[int, list[int]],
    exclude: frozenset[int] = frozenset(),
) -> dict[int, psutil.Process]:
    """The rank's live processes: its verified root, everything below it, and known orphans
    (less the `exclude`d subtrees). `trees`: each rank's processes as the last sample found them,
    kept there for the next (psutil measures CPU between calls on the same Process object)."""
    known = trees.setdefault(key, {})
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
        except GONE:
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
                except GONE:
                    continue
                todo.append(child)
    trees[key] = live
    return live


def measure(procs: dict[int, psutil.Process], titles: dict | None) -> tuple[float, int, list[dict]]:
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
        except GONE:
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
