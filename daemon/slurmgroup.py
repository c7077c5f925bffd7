"""A rank group run as one Slurm job (`[resources] executor = "slurm"`): the same attempt directory, records and root-cause rules as a local group (daemon/group.py), with Slurm starting, watching and ending the processes.

The daemon writes the attempt's batch script and submits it (daemon/slurmjob.py); `srun` starts
one task per rank on the nodes Slurm picks, and each task becomes the same rank monitor and
runtime as a local rank (workers/runtime/slurm_task.py), so the logs, `rank-<r>.error.json`,
exit records and progress files land in the attempt directory, which must lie on a filesystem
every node sees. The daemon never touches a Slurm rank's processes: their pids mean something
only on their node. What it knows of a rank comes from those files; what it knows of the job
comes from Slurm (scontrol, sacct), and it ends the job with scancel.

How an end is read:
- the ranks' exit and error records say how each rank ended, as locally;
- a job that Slurm itself ends (TIMEOUT, NODE_FAIL, PREEMPTED, OUT_OF_MEMORY, ...) is recorded
  with Slurm's state and reason as the root cause, and the ranks' deaths it caused (SIGTERM from
  Slurm, records missing from a dead node) are its consequences. Because Slurm shows a dying job
  only as COMPLETING, the ranks' exits are held back while it is, until the state it ends in is
  known;
- a job cancelled from outside eyas (scancel by a user or an admin) is a stop, as `eyas stop`;
- ranks that left no exit record once the job is over are lost, as locally.

Every Slurm client call (sbatch, scontrol, scancel) is an RPC to slurmctld that can hang for
slurmjob.TIMEOUT_S: none runs on the daemon's event loop, which goes on serving clients and
other runs while a controller is slow or down. A job's state is read from the last answer
(read_job) while the next query runs in a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from eyas.state import contract, slurm, specs
from eyas.state.contract import ErrorRecord

from . import slurmjob, stacks
from .group import Group, make_attempt_dir
from .phases import node_tree
from .ranks import Rank, RankExit, read_json, tail_text

log = logging.getLogger("eyas.daemon.slurmgroup")

JOB_FILE = "slurm-job.json"  # {"job_id", "name"} beside the ranks' files: re-adoption reads it
SCRIPT_FILE = "job.sbatch"
POLL_S = 1.0  # how often Slurm is asked about a job: an RPC to slurmctld, not a local read
# How long the ranks' records may lag the job's end (the shared filesystem's attribute cache
# on another node) before a rank without one is settled as lost.
RECORD_LAG_S = 5.0
# A rank's exception older than Slurm's ending by this much is its own failure, not the ending's:
# the end time is Slurm's, to the second, the exception's the node's clock.
END_SLACK_S = 1.0
KILL_WAIT_MAX_S = 120.0  # after scancel: Slurm's KillWait and epilog, at most this long
# Ranks' records wait this long for an answer from Slurm asked after they came (is the job still
# running?); past it, a controller that does not answer leaves the ranks' own records to decide.
STALE_MAX_S = slurmjob.TIMEOUT_S + 2 * POLL_S

# The pollers' threads: each live job has at most one query in flight, so a few threads serve
# every job, and a hung controller ties up threads, never the event loop.
_CLIENTS = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="eyas-slurm")


def recorded_job(attempt_dir: Path) -> int | None:
    """The job id the attempt's folder records (JOB_FILE), if any."""
    found = read_json(attempt_dir / JOB_FILE) or {}
    job = found.get("job_id")
    return job if isinstance(job, int) else None


@dataclass
class SlurmGroup(Group):
    """One attempt of one stage as a Slurm job."""

    job_id: int | None = None
    job_name: str = ""
    job: slurmjob.JobState | None = None  # the last reading
    job_asked_at: float = 0.0  # when the query that gave `job` started
    queried_at: float = 0.0  # when the last query started
    asking: tuple[float, concurrent.futures.Future] | None = None  # the query in flight, and its start
    records_seen: dict[int, float] = field(default_factory=dict)  # rank -> when its exit record was first read
    slurm_end: slurmjob.JobState | None = None  # Slurm ended the job, not eyas and not its ranks
    ended_seen_at: float | None = None  # when the job was first seen over
    consequences: set[int] = field(default_factory=set)  # ranks whose end Slurm's ending caused
    nodes: str | None = None  # the allocation's hostlist, once Slurm gave one
    nodes_told: str | None = None  # the last one new_nodes() handed out to be recorded
    native_asked_at: float = 0.0  # when stacks were last asked of the nodes (request_stacks)

    # Nothing of a Slurm rank runs on the daemon's host: no process to sample, signal or find.
    local_processes = False

    # -- start -------------------------------------------------------------------------

    @classmethod
    def submit(
        cls,
        *,
        run_id: int,
        stage: str,
        attempt_id: int,
        attempt: int,
        dir: Path,
        world_size: int,
        output_dir: Path,
        config_path: Path | None,
        python: str,
        slurm_cfg: dict,
        extra_env: dict[str, str] | None = None,
    ) -> SlurmGroup:
        make_attempt_dir(dir)
        group = cls(run_id, stage, attempt_id, attempt, dir, world_size, [], 0)
        group.job_name = slurmjob.job_name(run_id, stage, attempt)
        exports = slurm.attempt_exports(
            run_id=run_id,
            stage=stage,
            attempt=attempt,
            attempt_dir=dir,
            output_dir=output_dir,
            config_path=config_path,
        )
        exports.update(extra_env or {})
        exports["PYTHONUNBUFFERED"] = "1"
        path = dir / SCRIPT_FILE
        path.write_text(
            slurmjob.script(
                name=group.job_name,
                attempt_dir=dir,
                world_size=world_size,
                exports=exports,
                python=python,
                slurm=slurm_cfg,
                gpus=specs.STAGES[stage].gpus,
            )
        )
        group.job_id = slurmjob.submit(path)
        # Beside the ranks' files at once: a daemon killed before the store has the id finds it here.
        (dir / JOB_FILE).write_text(f'{{"job_id": {group.job_id}, "name": "{group.job_name}"}}\n')
        group.master_port = slurm.master_port(group.job_id)
        group.ranks = [group.slot(r) for r in range(world_size)]
        log.info("run %s: %s attempt %d submitted as Slurm job %d", run_id, stage, attempt, group.job_id)
        return group

    def slot(self, r: int) -> Rank:
        """Rank `r` as known before its task has started: its log's place and nothing else."""
        return Rank(r, self.dir / contract.rank_file(r, contract.LOG), 0, None)

    # -- watch -------------------------------------------------------------------------

    def _learn_worker(self, rank: Rank) -> bool:
        """The rank's monitor and worker from its proc file, when it names this job."""
        if rank.pid is not None:
            return False
        proc = read_json(self.dir / contract.rank_file(rank.rank, contract.PROC))
        if not proc or proc.get("slurm_job") != self.job_id:
            return False
        rank.monitor_pid, rank.monitor_create_time = proc.get("monitor_pid") or 0, proc.get("monitor_create_time")
        rank.pid, rank.create_time, rank.host = proc.get("pid"), proc.get("create_time"), proc.get("host")
        return True

    # vLLM's TP workers are watched through pidfds on the daemon's host; a Slurm driver's
    # workers live on its node, so only the driver's own records are read.
    def _learn_tp(self) -> list[Rank]:
        return []

    def _poll_tp(self, final: bool = False) -> list[RankExit]:
        return []

    def read_job(self, now: float, fresh_since: float | None = None) -> slurmjob.JobState | None:
        """The last answer about the job's state, never waiting on Slurm: a query starts in a
        thread at most every POLL_S, or at once when the answer was asked before `fresh_since`,
        and its answer is taken on a later call. A query Slurm does not answer is logged, and
        the next call asks again."""
        if self.job_id is None:
            return None
        self._take_answer()
        stale = fresh_since is not None and self.job_asked_at < fresh_since
        if self.asking is None and (stale or self.job is None or now - self.queried_at >= POLL_S):
            self.queried_at = now
            self.asking = (now, _CLIENTS.submit(slurmjob.query, self.job_id))
        return self.job

    def _take_answer(self) -> None:
        if self.asking is None or not self.asking[1].done():
            return
        (asked, future), self.asking = self.asking, None
        try:
            self._keep(future.result(), asked)
        except OSError as exc:  # SlurmError, or the client could not even be run
            log.warning("run %s: %s attempt %d: %s", self.run_id, self.stage, self.attempt, exc)

    def _keep(self, job: slurmjob.JobState, asked: float) -> None:
        # An answer is kept only if no later-asked one is: queries overlap during a teardown.
        if asked >= self.job_asked_at:
            self.job, self.job_asked_at = job, asked

    async def ask_job(self) -> slurmjob.JobState | None:
        """The job's state now, waited for in a thread (a teardown's); the last answer when Slurm
        does not give one."""
        if self.job_id is None:
            return None
        asked = time.time()
        try:
            self._keep(await asyncio.to_thread(slurmjob.query, self.job_id), asked)
        except OSError as exc:
            log.warning("run %s: %s attempt %d: %s", self.run_id, self.stage, self.attempt, exc)
        return self.job

    def poll(self) -> tuple[list[Rank], list[RankExit]]:
        now = time.time()
        learnt = [r for r in self.ranks if r.exit is None and self._learn_worker(r)]
        waiting = [r for r in self.ranks if r.exit is None]
        ready = [r for r in waiting if self._exit_record(r) is not None]
        # The ranks' ends are read against an answer asked after their records were read: Slurm
        # moves a job to COMPLETING before it signals the tasks, so a job still running then had
        # not ended the ranks whose records came.
        seen = max((self.records_seen.setdefault(r.rank, now) for r in ready), default=None)
        job = self.read_job(now, fresh_since=seen)
        if job is None:
            if self.job_id is None:  # never submitted (or its id lost with the last daemon)
                return learnt, [self._end(r, lost=True) for r in waiting]
            return learnt, []
        if job.nodes and job.nodes != self.nodes:
            self.nodes = job.nodes
        if job.state == "PENDING":
            # Waiting in Slurm's queue is not a hang: the stall clock starts once the job runs.
            self.active_at = now
        if seen is not None and self.job_asked_at < seen and now - seen < STALE_MAX_S:
            return learnt, []  # the answer that can tell is asked for: a later pass reads it
        if job.live or (job.completing and self.teardown_since is not None):
            return learnt, [self._end(r) for r in ready]
        if job.completing:
            return learnt, []  # its end state is not known yet: see the module's docstring
        if self.ended_seen_at is None:
            self.ended_seen_at = now
            if self.teardown_since is None and job.state not in slurmjob.NATURAL and job.state != slurmjob.UNKNOWN:
                self.slurm_end = job
                log.warning(
                    "run %s: %s attempt %d: Slurm ended job %d: %s",
                    self.run_id,
                    self.stage,
                    self.attempt,
                    self.job_id,
                    job.words,
                )
                if job.state == "CANCELLED" and self.cancel_reason is None:
                    self.cancel_reason = f"Slurm job {self.job_id} was cancelled outside eyas (scancel): {job.words}"
        exits = [self._end(r) for r in ready]
        if now - self.ended_seen_at >= RECORD_LAG_S:
            exits += [self._end(r, lost=True) for r in waiting if r not in ready]
        return learnt, exits

    def new_nodes(self) -> str | None:
        if self.nodes is None or self.nodes == self.nodes_told:
            return None
        self.nodes_told = self.nodes
        return self.nodes

    def _exit_record(self, rank: Rank) -> dict | None:
        return self.own_record(contract.rank_file(rank.rank, contract.EXIT), {rank.pid}, pid_unknown=rank.pid is None)

    def _end(self, rank: Rank, lost: bool = False) -> RankExit:
        self._learn_worker(rank)
        ex = self._settle(rank, None)
        if self.slurm_end is not None:
            end = self.slurm_end.end_time or self.ended_seen_at or ex.time
            own = ex.error is not None and float(ex.error.get("time") or ex.time) < end - END_SLACK_S
            if not own:
                self.consequences.add(rank.rank)
        rank.exit = ex
        return ex

    def counts_as_failure(self, ex: RankExit) -> bool:
        if ex.tp_rank is None and ex.rank in self.consequences:
            return False
        return super().counts_as_failure(ex)

    def outside_end(self, host: str) -> ErrorRecord | None:
        """Slurm's ending of the job as the root-cause record; None when Slurm did not end it
        or ended it as a stop (a cancel from outside eyas)."""
        job = self.slurm_end
        if job is None or job.state == "CANCELLED":
            return None
        out = self.dir / f"slurm-{self.job_id}.out"
        # Slurm's own account of the ending ("*** JOB 7 ON node1 CANCELLED AT ... DUE TO TIME
        # LIMIT ***") is in the job's output; the ranks wrote their lines into their own logs.
        said = [line for line in tail_text(out).splitlines() if "***" in line or "error" in line.lower()]
        return ErrorRecord(
            type=job.state,
            message=f"Slurm ended job {self.job_id} ({self.job_name}) on {job.nodes or 'no node'}: {job.words}",
            traceback="\n".join(said[-20:]),
            time=job.end_time or self.ended_seen_at or time.time(),
            source="slurm",
            host=job.nodes,
            path=str(out),
        )

    # -- stacks ------------------------------------------------------------------------

    async def request_stacks(self, members: list[Rank], descendants: bool = False) -> list[dict]:
        """Ask every live rank for its Python stacks with one `scancel --signal=USR1` (in a
        thread): Slurm delivers it on each node (the launcher made the signal harmless until a
        rank registers its dump), and each rank's monitor then takes its processes' native
        stacks there (workers/runtime/tree.py), which collect_stacks reads back."""
        out = []
        for r in members:
            entry = {"rank": r.rank, "role": r.role, "tp_rank": r.tp_rank, "pid": r.pid, "log_path": str(r.log_path)}
            if r.exit is not None or r.pid is None:
                entry["skipped"] = "not running" if r.exit is not None else "not started yet"
            else:
                entry["offset"] = _size(r.log_path)
            out.append(entry)
        now = time.time()
        for r in members:  # the nodes' latest word, not the last sample's (daemon/metrics.py)
            procs = node_tree(self.dir / contract.rank_file(r.rank, contract.TREE), now) if r.tp_rank is None else None
            if r.exit is None and procs is not None:
                self.vitals.update_procs(self, r.rank, procs, now)
        out = stacks.with_descendants(out, self.vitals, now, descendants)
        self.native_asked_at = now
        if any("offset" in e for e in out):
            try:
                await asyncio.to_thread(slurmjob.signal, self.job_id, "USR1")
            except slurmjob.SlurmError as exc:
                for e in out:
                    if e.pop("offset", None) is not None:
                        e["python_skipped"] = str(exc)
        return out

    async def collect_stacks(self, members: list[Rank], descendants: bool = False, **kwargs) -> list[dict]:
        asked = await self.request_stacks(members, descendants)
        native_timeout = kwargs.pop("native_timeout", stacks.native.TIMEOUT)
        entries = await stacks.collect(members, requester=lambda _: asked, native_stacks=False, **kwargs)
        await self._node_native(entries, native_timeout)
        return entries

    async def _node_native(self, entries: list[dict], timeout: float) -> None:
        """Each live process's native stacks, as its rank's monitor wrote them on its node
        (rank-<r>.native.json, newer than the request), waiting up to `timeout` for them."""
        want = {e["rank"] for e in entries if "skipped" not in e and e.get("role") != "tp-worker"}
        deadline = time.monotonic() + timeout
        dumps: dict[int, dict] = {}
        while True:
            for r in want - set(dumps):
                record = read_json(self.dir / contract.rank_file(r, contract.NATIVE))
                if isinstance(record, dict) and float(record.get("time") or 0) >= self.native_asked_at - 1.0:
                    dumps[r] = record.get("dumps") or {}
            if set(dumps) >= want or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.1)
        for e in entries:
            if "skipped" in e or "native" in e or "native_skipped" in e:
                continue
            found = dumps.get(e["rank"], {}).get(str(e.get("pid")))
            e.update(found or {"native_skipped": f"its node's monitor wrote no native stacks within {timeout:g} s"})

    # -- tear down ---------------------------------------------------------------------

    def member_pids(self) -> set[int]:
        return set()  # its processes are Slurm's to find, on their nodes

    async def _teardown(self, grace: float) -> None:
        """SIGTERM to every task (the monitors pass it on), `grace` to end, then scancel, which
        ends what is left (SIGKILL after Slurm's KillWait); returns once Slurm says it is over."""
        if self.job_id is None:
            return
        job = await self.ask_job()
        if job is not None and job.state == "RUNNING":
            try:
                await asyncio.to_thread(slurmjob.signal, self.job_id, "TERM")
            except slurmjob.SlurmError as exc:
                log.info("group %s/%s: %s", self.run_id, self.stage, exc)
            job = await self._wait_over(grace)
        if job is not None and not job.ended:
            try:
                await asyncio.to_thread(slurmjob.cancel, self.job_id)
            except slurmjob.SlurmError as exc:
                log.warning("group %s/%s: %s", self.run_id, self.stage, exc)
            job = await self._wait_over(KILL_WAIT_MAX_S)
            if job is not None and not job.ended:
                log.error("group %s/%s: Slurm job %d is still %s", self.run_id, self.stage, self.job_id, job.state)

    async def _wait_over(self, seconds: float) -> slurmjob.JobState | None:
        deadline = time.monotonic() + seconds
        job = self.job
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            job = await self.ask_job()
            if job is None or job.ended:
                break
        return job


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def adopt_job(group: SlurmGroup, attempt: dict) -> None:
    """Give a re-adopted attempt its Slurm job back: the id the store recorded, else the one its
    folder recorded, else the live job of its name (a daemon killed between sbatch and both)."""
    group.job_name = slurmjob.job_name(group.run_id, group.stage, group.attempt)
    group.job_id = attempt.get("slurm_job") or recorded_job(group.dir)
    if group.job_id is None:
        try:
            group.job_id = slurmjob.find(group.job_name)
        except slurmjob.SlurmError as exc:
            log.warning("run %s: %s attempt %d: %s", group.run_id, group.stage, group.attempt, exc)
    group.nodes = group.nodes_told = attempt.get("nodes")
    if group.job_id is not None:
        group.master_port = slurm.master_port(group.job_id)
    log.info("run %s: %s attempt %d: re-adopting Slurm job %s", group.run_id, group.stage, group.attempt, group.job_id)
