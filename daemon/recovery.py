"""Recovery: a daemon that starts re-adopts the ranks of the attempts the last one left running, finishes starting an attempt it died in the middle of, and warns about run folders the database does not know.

A rank is adopted only if its monitor's pid *and* start time match, so a recycled pid is never
mistaken for it; ranks that ended meanwhile are settled from their exit records and error
files on the first supervision pass.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import psutil

from eyas.state import contract, paths, store

from . import intent, oom
from .group import Group, free_port
from .limits import log_max_mb, set_bounds
from .logsplit import LogSplitter
from .ranks import Rank, RankExit, read_json
from .slurmgroup import SlurmGroup, adopt_job

log = logging.getLogger("eyas.daemon.recovery")


class Recovery:
    """The start-up half of the daemon's Core (daemon/core.py)."""

    @staticmethod
    def _running_attempts(db) -> list[tuple[dict, dict, float | None, dict, dict]]:
        """Each running attempt with its ranks' rows, its last stored metric time, its run's
        config and its run's row."""
        found = []
        for a in db["attempts"].rows_where("state = 'running'"):
            rows = {r["rank"]: r for r in db["ranks"].rows_where("attempt_id = ?", [a["id"]])}
            since = db.execute(
                "SELECT max(time) FROM metrics WHERE run_id = ? AND stage = ? AND attempt = ?",
                [a["run_id"], a["stage"], a["number"]],
            ).fetchone()[0]
            run = db["runs"].get(a["run_id"])
            found.append((a, rows, since, json.loads(run["config_json"] or "{}"), run))
        return found

    async def recover(self) -> None:
        """Re-adopt the ranks of attempts that were running when the last daemon died.

        A rank is adopted only if its monitor's pid *and* start time match, so a recycled
        pid is never mistaken for it; ranks that ended meanwhile are settled from their
        exit records and error files on the first supervision pass.
        """
        for a, rows, since, cfg, run in await self.write(self._running_attempts, "reading the attempts to re-adopt"):
            attempt_dir = Path(a["dir"])
            on_slurm = (cfg.get("resources") or {}).get("executor") == "slurm"
            group = (SlurmGroup if on_slurm else Group)(
                a["run_id"],
                a["stage"],
                a["id"],
                a["number"],
                attempt_dir,
                a["world_size"],
                json.loads(a["devices"] or "[]"),
                a["master_port"] or 0,
                started_at=a["started_at"] or time.time(),
            )
            if on_slurm:
                await asyncio.to_thread(adopt_job, group, a)  # may ask squeue: off the event loop
            unstarted, found_later = [], []
            for r in range(a["world_size"]):
                row = rows.get(r) or {}
                proc = read_json(attempt_dir / contract.rank_file(r, contract.PROC)) or {}
                if not row and not proc and not (attempt_dir / contract.rank_file(r, contract.LOG)).exists():
                    unstarted.append(r)  # the log is made just before the process: never begun
                mpid = row.get("monitor_pid") or proc.get("monitor_pid")
                mct = row.get("monitor_create_time") or proc.get("monitor_create_time")
                if on_slurm:
                    unstarted, mpid = [], None  # Slurm starts its tasks; their proc files name them
                elif not mpid and (found := intent.find_monitor(group, r)) is not None:
                    mpid, mct = found
                if mpid and not row.get("monitor_pid"):
                    found_later.append((r, mpid, mct))  # its row was never written: now it is
                rank = Rank(
                    r,
                    attempt_dir / contract.rank_file(r, contract.LOG),
                    mpid or 0,
                    mct,
                    None,
                    row.get("pid") or proc.get("pid"),
                    row.get("create_time") or proc.get("create_time"),
                    row.get("device"),
                )
                if row.get("state") in ("exited", "failed", "killed"):
                    rank.exit = RankExit(
                        r,
                        rank.pid,
                        row.get("exit_code"),
                        row.get("signal"),
                        row.get("ended_at") or time.time(),
                        group.rank_error(rank),
                    )
                rank.role = row.get("role")
                if on_slurm and rank.exit is None:
                    rank = group.slot(r)  # learnt again from its proc file, which names the job
                group.ranks.append(rank)
            self._recover_workers(group, rows.values())
            # Progress lines already stored by the previous daemon feed the rates but are
            # not inserted twice.
            group.metrics_since = since
            set_bounds(group, cfg)
            if found_later:
                self.write_later(
                    lambda db, a=a["id"], found=found_later: [
                        store.upsert_rank(db, a, r, monitor_pid=mpid, monitor_create_time=mct, host=self.host)
                        for r, mpid, mct in found
                    ],
                    f"recording the re-adopted ranks of run {a['run_id']}",
                )
            if unstarted and intent.stop_of(a) is None and not a.get("stuck_json"):
                self._finish_spawn(group, unstarted, run, cfg)
            self.groups[a["id"]] = group
            intent.resume(self, group, a)
            log.info(
                "re-adopted run %s %s attempt %s (%s ranks)", a["run_id"], a["stage"], a["number"], a["world_size"]
            )

    def _finish_spawn(self, group: Group, unstarted: list[int], run: dict, cfg: dict) -> None:
        """The last daemon died while starting this attempt's ranks (after recording the
        attempt, before the last process began): start the missing ones into it, with the
        rendezvous port its started ranks were given, rather than settling a rank that never
        existed as Lost and starting another attempt beside them."""
        started = [r for r in group.ranks if r.rank not in unstarted]
        port = group.master_port or _master_port_of(started) or free_port()
        group.master_port = port
        run_dir = paths.run_dir(run, self.home)
        output_dir = Path(run["output_dir"] or run_dir / "out")
        output_dir.mkdir(parents=True, exist_ok=True)
        group.dir.mkdir(parents=True, exist_ok=True)
        if not started:
            group.oom_before = oom.oom_kill_count()
        env = {contract.LOG_MAX_MB: f"{log_max_mb(cfg, group.stage):g}"}
        try:
            for r in unstarted:
                group.ranks[r] = group._start_rank(r, output_dir, run_dir / "config.json", env)
        except OSError:
            log.exception(
                "run %s: %s attempt %d: could not finish starting its ranks", group.run_id, group.stage, group.attempt
            )
            return
        log.warning(
            "run %s: %s attempt %d: the last daemon died while starting its ranks; started rank%s %s now (port %d)",
            group.run_id,
            group.stage,
            group.attempt,
            "" if len(unstarted) == 1 else "s",
            ", ".join(map(str, unstarted)),
            port,
        )
        self.record_started(
            group,
            [group.ranks[r] for r in unstarted],
            f"recording the ranks started for run {group.run_id} {group.stage}",
        )

    async def check_run_folders(self) -> None:
        """Warn, once at start, about run folders that no run of the database records: the
        database was deleted or an older backup restored since they were written. They are
        another history's logs and outputs: left alone, and new runs get ids above them."""
        rows = await self.write(lambda db: list(db.query("SELECT id, dir FROM runs")), "reading the run folders")
        known = {paths.run_dir(row, self.home).resolve() for row in rows}
        unknown = sorted(i for i, path in paths.folder_ids(self.home).items() if path.resolve() not in known)
        if unknown:
            log.warning(
                "%s holds %d run folder%s that the database does not know (ids %s): written before "
                "the database was deleted or restored from a backup; they are left alone, and new "
                "runs get ids above them",
                paths.runs_dir(self.home),
                len(unknown),
                "" if len(unknown) == 1 else "s",
                _id_ranges(unknown),
            )

    @staticmethod
    def _recover_workers(group: Group, rows) -> None:
        """Re-adopt a vLLM driver's TP workers; their log split resumes from its state file."""
        for row in rows:
            if row.get("role") != "tp-worker" or row.get("tp_rank") is None:
                continue
            k = row["tp_rank"]
            parent = row.get("parent_rank") or 0
            driver = group.ranks[parent] if 0 <= parent < len(group.ranks) else None
            w = Rank(
                row["rank"],
                group.dir / contract.tp_file(k, contract.LOG),
                driver.monitor_pid if driver else 0,
                driver.monitor_create_time if driver else None,
                None,
                row.get("pid"),
                row.get("create_time"),
                row.get("device"),
                role="tp-worker",
                tp_rank=k,
                started_at=row.get("started_at"),
            )
            if row.get("state") in ("exited", "failed", "killed"):
                w.exit = RankExit(
                    row["rank"],
                    w.pid,
                    row.get("exit_code"),
                    row.get("signal"),
                    row.get("ended_at") or time.time(),
                    group.tp_error(w),
                    unexpected=row.get("state") == "failed",
                    tp_rank=k,
                )
            group.workers[k] = w
        if group.workers and group.ranks:
            driver = group.ranks[0]
            group.splitter = LogSplitter(driver.log_path, group.dir / contract.rank_file(driver.rank, contract.SPLIT))


def _id_ranges(ids: list[int]) -> str:
    """Sorted ids, runs of consecutive ones shortened: [1, 2, 3, 7] -> "1-3, 7"."""
    spans: list[list[int]] = []
    for i in ids:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _master_port_of(ranks: list[Rank]) -> int | None:
    """The MASTER_PORT the daemon gave ranks that are running (from their monitors' environment)."""
    for r in ranks:
        try:
            port = psutil.Process(r.monitor_pid).environ().get(contract.MASTER_PORT) if r.monitor_pid else None
        except (psutil.Error, OSError):
            continue
        if port and port.isdigit():
            return int(port)
    return None
