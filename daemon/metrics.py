"""Metrics: sample the live ranks once a second (daemon/sampler.py), publish the samples to subscribers, and hand them to the store thread in one write however long a lock holds it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from eyas.state import contract, store

from . import tensorboard
from .group import Group
from .phases import node_tree
from .rankprogress import newest_mtime
from .ranks import Rank
from .sampler import RankRef


def _running(rank: Rank) -> bool:
    """Still worth sampling: not ended, or ended only by its own error record (it may live on)."""
    return rank.exit is None or (rank.exit.error is not None and rank.exit.signal is None)


def _ref(g: Group, member: Rank, progress: Path, exclude: frozenset[int] = frozenset()) -> RankRef:
    """What the sampler measures of one member: a driver rank from its monitor down, a TP worker
    from its own pid."""
    pid, create_time = (
        (member.pid, member.create_time)
        if member.tp_rank is not None
        else (member.monitor_pid, member.monitor_create_time)
    )
    if not g.local_processes:
        # A Slurm rank's pid names a process on its node: only its progress file is read here.
        pid, create_time = None, None
    return RankRef(
        g.run_id,
        g.stage,
        g.attempt,
        g.attempt_id,
        member.rank,
        pid,
        create_time,
        progress,
        g.metrics_since,
        exclude=exclude,
        log_path=member.log_path,
    )


class Metrics:
    """The sampling half of the daemon's Core (daemon/core.py)."""

    _metrics_lock: threading.Lock

    def sample(self, now: float, groups: list[Group] | None = None, final: bool = False) -> None:
        """Sample the live ranks (or, with `final`, every rank of `groups` one last time, so
        that the progress lines written just before exiting are not lost)."""
        groups = list(self.groups.values()) if groups is None else groups
        refs = []
        for g in groups:
            # A TP worker is measured as its own rank, so its tree is kept out of its driver's.
            tp_pids = frozenset(w.pid for w in g.workers.values() if w.pid)
            refs += [
                _ref(g, r, g.dir / contract.rank_file(r.rank, contract.PROGRESS), exclude=tp_pids)
                for r in g.ranks
                if final or r.exit is None
            ]
            refs += [
                _ref(g, w, g.dir / contract.tp_file(k, contract.PROGRESS))
                for k, w in sorted(g.workers.items())
                if final or _running(w)
            ]
        if not refs:
            return
        result = self.sampler.sample(refs, now)
        tensorboard.boards(self).add(result.metrics, groups)  # [tracking] tensorboard: the rows the store gets
        self._ended_writes(groups, result.writes)
        for (attempt_id, _rank), pids in result.descendants.items():
            group = self.groups.get(attempt_id)
            if group is not None:
                group.seen.update(pids)
        # Stamped after the sample, not with the loop's `now`: a state seen then may be newer
        # than `now`, and a stopped process must never look stopped for longer than it was.
        if self.sampler.watching:  # sampler.WATCH_ENV=off: the benchmark's baseline
            self._watch(groups, result, time.time())
        attempt_of = {(g.run_id, g.stage): g.attempt_id for g in groups}
        self.stage_live.update(result.stages)
        # The last write joins the ranks' roll-up, written each second already: no extra write.
        ranks = {key: dict(fields) for key, fields in result.ranks.items()}
        for key, wrote in result.writes.items():
            ranks.setdefault(key, {})["last_write"] = wrote
        self._queue_metrics(result.metrics, ranks, {attempt_of[key]: key for key in result.stages})
        by_group: dict[tuple, list] = {}
        for row in result.metrics:
            if row["run_id"] is not None:
                by_group.setdefault((row["run_id"], row["stage"], row["attempt"]), []).append(row)
        # When each rank last wrote, for the live views' "last write" (the store has it too,
        # a second later): {rank: unix time}, rank numbers as strings (JSON's keys).
        wrote: dict[tuple, dict[str, float]] = {}
        group_of = {g.attempt_id: g for g in groups}
        for (attempt_id, rank), t in result.writes.items():
            g = group_of.get(attempt_id)
            if g is not None:
                key = (g.run_id, g.stage, g.attempt)
                wrote.setdefault(key, {})[str(rank)] = t
                by_group.setdefault(key, [])
        # Each rank's open phase (sampler.SampleResult.phases), so that the live views say what a
        # silent stage waits for: {rank: {"phase", "kind", "since", "budget", "waits"}}.
        phases: dict[tuple, dict[str, dict]] = {}
        for (attempt_id, rank), phase in result.phases.items():
            g = group_of.get(attempt_id)
            if g is not None:
                shown = {k: phase.get(k) for k in ("phase", "kind", "since", "budget", "waits")}
                phases.setdefault((g.run_id, g.stage, g.attempt), {})[str(rank)] = shown
        for (run_id, stage, attempt), rows in by_group.items():
            self.publish(
                "metric",
                {
                    "run_id": run_id,
                    "stage": stage,
                    "attempt": attempt,
                    "samples": rows,
                    "live": self.stage_live.get((run_id, stage)),
                    "last_write": wrote.get((run_id, stage, attempt), {}),
                    "phases": phases.get((run_id, stage, attempt), {}),
                },
            )

    @staticmethod
    def _watch(groups: list[Group], result, now: float) -> None:
        """Hand each group's watch (daemon/phases.py) its members' processes, phases and life."""
        for g in groups:
            members = [r.rank for r in g.ranks] + [w.rank for w in g.workers.values()]
            sampled = False
            for member in members:
                key = (g.attempt_id, member)
                if key in result.procs or key in result.writes or key in result.phases:
                    # A Slurm rank's processes are on its node: its monitor reports them (tree.json).
                    procs = result.procs.get(key, []) if g.local_processes else None
                    g.vitals.update(g, member, procs, result.phases.get(key), result.writes.get(key), now)
                    sampled = True
                elif g.local_processes:
                    g.vitals.update_procs(g, member, [], now)  # ended: its processes are gone
            if not g.local_processes:
                for r in g.ranks:
                    procs = node_tree(g.dir / contract.rank_file(r.rank, contract.TREE), now) if r.exit is None else []
                    if procs is not None:
                        g.vitals.update_procs(g, r.rank, procs, now)
                        sampled = True
            if sampled:
                g.vitals.settle_cpu(now)

    def _ended_writes(self, groups: list[Group], writes: dict) -> None:
        """Add to `writes` the last write of members that ended and are sampled no more, when
        it moved: what a rank wrote on its way out (its last lines, its final progress) lands
        after its last sample. Each member keeps the time last sent, so an ended rank costs
        its two stats a second and no write once its files are still."""
        for g in groups:
            members = [(r, g.dir / contract.rank_file(r.rank, contract.PROGRESS)) for r in g.ranks]
            members += [(w, g.dir / contract.tp_file(k, contract.PROGRESS)) for k, w in g.workers.items()]
            for member, progress in members:
                key = (g.attempt_id, member.rank)
                if key not in writes:
                    t = newest_mtime(member.log_path, progress)
                    if t is not None and t != member.last_write:
                        writes[key] = t
                if key in writes:
                    member.last_write = writes[key]

    def _queue_metrics(self, rows: list[dict], ranks: dict, stages: dict) -> None:
        """Hand a sample to the store thread. Samples taken while a write waits (a held lock)
        join the one queued write, so a long lock costs one transaction, not one per second."""
        with self._metrics_lock:
            buf = self._metrics_buf
            if buf is None:
                buf = self._metrics_buf = {"rows": [], "ranks": {}, "stages": {}}
                queue = True
            else:
                queue = False
            buf["rows"].extend(rows)
            for key, fields in ranks.items():
                buf["ranks"].setdefault(key, {}).update(fields)
            buf["stages"].update(stages)
        if queue:
            taken: list[dict] = []

            def write(db):
                if not taken:  # once: a try that met the lock keeps what it took
                    with self._metrics_lock:
                        taken.append(self._metrics_buf)
                        self._metrics_buf = None
                store.write_metrics(db, taken[0])

            self.write_later(write, "writing metrics to eyas.db")
