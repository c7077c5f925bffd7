"""A rank group: start N rank processes the way torchrun does, watch them, and tear the whole group down, descendants included.

Each rank is a `python -m <the rank monitor>` session leader (state/specs.py names it) whose
stdout and stderr are its own log file, so no byte of rank output passes through the daemon
and a daemon restart never stalls or kills a rank. The monitor records the worker's exit
status in `rank-<r>.exit.json`, which is how a restarted daemon settles ranks that ended while
it was down. A vLLM driver's tensor-parallel workers join the group as extra ranks
(daemon/tpworkers.py); which failure is the root cause is daemon/failures.py's to say.

An attempt's directory is created by `spawn` and by nothing else, so no other run's files can
be in it; still, a record is believed only when it is this attempt's (`Group.own_record`): an
exit, done or error file whose pid is not the process it describes, or whose stage or attempt
is another's, is ignored and logged, and the rank is settled by what is known of it otherwise.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from eyas.state import contract, procs, specs
from eyas.state.contract import ErrorRecord

from . import failures as root_cause
from . import oom, stacks
from .logsplit import LogSplitter
from .phases import Watch
from .ranks import Rank, RankExit, create_time, read_json
from .tpworkers import TPWorkers

log = logging.getLogger("eyas.daemon.group")


def free_port() -> int:
    """A free TCP port on loopback for MASTER_PORT, found as torchrun does: bind port 0."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Group(TPWorkers):
    """One attempt of one stage: N ranks that live and die together."""

    run_id: int
    stage: str
    attempt_id: int
    attempt: int
    dir: Path
    world_size: int
    devices: list[int]
    master_port: int
    ranks: list[Rank] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    teardown_since: float | None = None
    tearing: bool = False  # a teardown is in progress: settle only after it ends
    cancel_reason: str | None = None
    oom_before: int | None = None
    metrics_since: float | None = None  # set on re-adoption: samples up to here are stored
    # (pid, create_time) of every process seen in the ranks' trees, fed by the sampler, so
    # that teardown also finds children that left the ranks' sessions.
    seen: set[tuple[int, float]] = field(default_factory=set)
    # Tensor-parallel workers of a vLLM driver (rank 0), by TP rank.
    workers: dict[int, Rank] = field(default_factory=dict)
    splitter: LogSplitter | None = None
    leftovers_ended: bool = False  # the driver ranks ended and their leftovers were torn down
    pidfds: dict[int, int] = field(default_factory=dict)  # TP rank -> pidfd watched by the event loop
    # The hang watchdog (daemon/watchdog.py): seconds of quiet allowed (0: off), seconds a
    # rank may outlive its work or its peers (0: off), when the attempt directory last changed
    # and how it looked; once stuck, the rule's record (with the stacks under "asked" once
    # they are collected: the group is settled only after).
    stall_timeout: float = 0.0
    exit_timeout: float = 0.0
    active_at: float = field(default_factory=time.time)
    activity: tuple = ()
    stuck: dict | None = None
    # Every process under the ranks, each rank's open phase and its last sign of life (daemon/phases.py),
    # and the run's `[stages.<name>] phase_budgets` by phase kind.
    # (Not `watch`: TPWorkers.watch is the method that watches a TP worker's pidfd.)
    vitals: Watch = field(default_factory=Watch)
    phase_budgets: dict[str, float] = field(default_factory=dict)
    ignored: set = field(default_factory=set)  # records refused by own_record, each logged once
    # The settlement (daemon/settle.py): what the end was, read once, and when to try again
    # to record it after a write failed (the group stays in memory until it is recorded).
    account: object | None = None
    settle_retry_at: float = 0.0
    settle_retries: int = 0
    settling: bool = False  # its settlement is queued on the store thread

    # Its processes run on the daemon's host, to be sampled, signalled and found by pid (a
    # Slurm group's do not: daemon/slurmgroup.py).
    local_processes = True

    # -- start -------------------------------------------------------------------------

    @classmethod
    def spawn(
        cls,
        *,
        run_id: int,
        stage: str,
        attempt_id: int,
        attempt: int,
        dir: Path,
        world_size: int,
        devices: list[int],
        output_dir: Path,
        config_path: Path | None,
        extra_env: dict[str, str] | None = None,
    ) -> Group:
        make_attempt_dir(dir)
        group = cls(run_id, stage, attempt_id, attempt, dir, world_size, devices, free_port())
        group.oom_before = oom.oom_kill_count()
        for r in range(world_size):
            group.ranks.append(group._start_rank(r, output_dir, config_path, extra_env or {}))
        return group

    def rank_devices(self, r: int) -> list[int]:
        """One GPU per rank when there are as many as ranks; a single rank (a vLLM driver
        with its TP workers) gets them all."""
        if not self.devices:
            return []
        if self.world_size == 1:
            return list(self.devices)
        per = max(1, len(self.devices) // self.world_size)
        return self.devices[r * per : (r + 1) * per]

    def _start_rank(self, r: int, output_dir: Path, config_path: Path | None, extra: dict) -> Rank:
        env = dict(os.environ)
        env.update(
            {
                contract.RANK: str(r),
                contract.WORLD_SIZE: str(self.world_size),
                contract.LOCAL_RANK: str(r),
                contract.LOCAL_WORLD_SIZE: str(self.world_size),
                contract.MASTER_ADDR: "127.0.0.1",
                contract.MASTER_PORT: str(self.master_port),
                contract.RUN_ID: str(self.run_id),
                contract.STAGE: self.stage,
                contract.ATTEMPT: str(self.attempt),
                contract.ATTEMPT_DIR: str(self.dir),
                contract.OUTPUT_DIR: str(output_dir),
                "PYTHONUNBUFFERED": "1",
            },
            **extra,
        )
        if config_path:
            env[contract.CONFIG] = str(config_path)
        devs = self.rank_devices(r)
        if devs:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devs))
        log_path = self.dir / contract.rank_file(r, contract.LOG)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        try:
            popen = subprocess.Popen(
                specs.argv(sys.executable),
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=fd,
                env=env,
                cwd=self.dir,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            os.close(fd)
        return Rank(r, log_path, popen.pid, create_time(popen.pid), popen, device=",".join(map(str, devs)) or None)

    # -- watch -------------------------------------------------------------------------

    def _learn_worker(self, rank: Rank) -> bool:
        """Pick up the worker's pid from the monitor's proc file; True when newly learnt."""
        if rank.pid is not None:
            return False
        proc = read_json(self.dir / contract.rank_file(rank.rank, contract.PROC))
        if proc and proc.get("monitor_pid") == rank.monitor_pid:
            rank.pid, rank.create_time = proc.get("pid"), proc.get("create_time")
            return True
        return False

    def own_record(self, name: str, pids: set[int | None], *, pid_unknown: bool = False) -> dict | None:
        """The JSON record `name` of the attempt directory, if this attempt's process wrote it.

        Its pid must be one of `pids` (the process it speaks for), or, where that process's
        pid was never learnt (`pid_unknown`: its proc file could not be written), the record
        must be no older than the attempt; and the stage and attempt it names, where it names
        them, must be this group's. Anything else is a leftover that another run or attempt
        wrote: it is ignored, logged once, and the rank is settled by what else is known.
        """
        record = read_json(self.dir / name)
        if record is None:
            return None
        if not isinstance(record, dict):
            record = {"pid": None, "time": None}  # nobody's: refused below, and logged
        known = {p for p in pids if p}
        pid, written = record.get("pid"), record.get("time")
        why = None
        if record.get("stage") not in (None, self.stage):
            why = f"it is stage {record['stage']}'s"
        elif record.get("attempt") not in (None, self.attempt):
            why = f"it is attempt {record['attempt']}'s"
        elif isinstance(pid, int) and pid in known:
            pass
        elif not pid_unknown:
            why = f"its pid {pid} is not {' or '.join(map(str, sorted(known))) or 'known'}"
        elif not isinstance(written, (int, float)) or written < self.started_at - procs.CREATE_TIME_SLACK_S:
            why = "it was written before this attempt started"
        if why is None:
            return record
        key = (name, pid, written)
        if key not in self.ignored:
            self.ignored.add(key)
            log.warning(
                "run %s: %s attempt %d: ignoring %s: %s (a leftover of another run or attempt)",
                self.run_id,
                self.stage,
                self.attempt,
                self.dir / name,
                why,
            )
        return None

    def rank_error(self, rank: Rank, worker_pid: int | None = None) -> dict | None:
        """rank-<r>.error.json, when this attempt's worker of the rank wrote it (or its monitor,
        which records a runtime that could not start). `worker_pid`: the pid the exit record
        names, where the proc file gave none."""
        worker = rank.pid or worker_pid
        return self.own_record(
            contract.rank_file(rank.rank, contract.ERROR), {worker, rank.monitor_pid}, pid_unknown=worker is None
        )

    def rank_of(self, number: int) -> Rank:
        """A rank by its number: a driver rank, or a TP worker (world_size + tp_rank)."""
        if number < len(self.ranks):
            return self.ranks[number]
        return self.workers[number - self.world_size]

    def poll(self) -> tuple[list[Rank], list[RankExit]]:
        """Check every live rank; returns (ranks whose worker pid was just learnt, new exits).
        TP workers come in both lists too, and an exit of theirs comes again when vLLM's
        report of it changes what it was."""
        learnt, exits = [], []
        learnt += self._learn_tp()
        exits += self._poll_tp()
        for rank in self.ranks:
            if rank.exit is not None:
                continue
            if self._learn_worker(rank):
                learnt.append(rank)
            if rank.popen is not None:
                rc = rank.popen.poll()
                if rc is None:
                    continue
            elif procs.alive(rank.monitor_pid, rank.monitor_create_time):
                continue
            else:
                rc = None
            self._learn_worker(rank)
            rank.exit = self._settle(rank, rc)
            exits.append(rank.exit)
        return learnt, exits

    def _settle(self, rank: Rank, monitor_rc: int | None) -> RankExit:
        record = self.own_record(contract.rank_file(rank.rank, contract.EXIT), {rank.pid}, pid_unknown=rank.pid is None)
        error = self.rank_error(rank, (record or {}).get("pid"))
        now = time.time()
        if record is not None:
            ex = RankExit(
                rank.rank,
                record.get("pid") or rank.pid,
                record.get("exit_code"),
                record.get("signal"),
                float(record.get("time") or now),
                error,
            )
        elif monitor_rc is not None:
            # The monitor itself ended without a record: killed along with its worker.
            sig = -monitor_rc if monitor_rc < 0 else None
            ex = RankExit(rank.rank, rank.pid or rank.monitor_pid, None if sig else monitor_rc, sig, now, error)
        else:
            ex = RankExit(
                rank.rank,
                rank.pid or rank.monitor_pid,
                None,
                None,
                float((error or {}).get("time") or now),
                error,
                lost=error is None,
            )
        if ex.signal == signal.SIGKILL and self.oom_before is not None:
            after = oom.oom_kill_count()
            ex.oom_killed = after is not None and after > self.oom_before
        return ex

    @property
    def collecting(self) -> bool:
        """The watchdog found the group stuck and is still collecting its stacks."""
        return self.stuck is not None and "asked" not in self.stuck

    @property
    def alive(self) -> bool:
        return any(r.exit is None for r in self.ranks)

    def counts_as_failure(self, ex: RankExit) -> bool:
        """A rank's own failure, as opposed to the signal eyas sent it while tearing down (daemon/failures.py)."""
        return root_cause.counts_as_failure(self, ex)

    def failures(self) -> list[RankExit]:
        """The ranks' own failures, earliest first: the first one is the root cause (daemon/failures.py)."""
        return root_cause.failures(self)

    # -- stacks and ends ----------------------------------------------------------------

    async def request_stacks(self, members: list[Rank], descendants: bool = False) -> list[dict]:
        """Ask the live members for their Python stacks (daemon/stacks.py); one record each, with
        its state, and with `descendants` one for every other live process under them."""
        return stacks.with_descendants(stacks.request(members), self.vitals, time.time(), descendants)

    async def collect_stacks(self, members: list[Rank], descendants: bool = False, **kwargs) -> list[dict]:
        """The members' (and with `descendants` every process under them) Python and native
        stacks (daemon/stacks.py's collect)."""
        return await stacks.collect(
            members,
            requester=lambda ranks: stacks.with_descendants(
                stacks.request(ranks), self.vitals, time.time(), descendants
            ),
            **kwargs,
        )

    def new_nodes(self) -> str | None:
        """The nodes the group was given, once, when newly known (a Slurm job's); None locally."""
        return None

    def outside_end(self, host: str) -> ErrorRecord | None:
        """The root cause when something outside the ranks ended the group (a Slurm group's
        scheduler: daemon/slurmgroup.py); a local group has none."""
        return None

    # -- tear down ---------------------------------------------------------------------

    def member_pids(self) -> set[int]:
        """Every live process of the group: the ranks' sessions, their process trees, and
        any descendant the sampler saw that has since left them."""
        # A rank whose monitor is unknown (0: the daemon died before learning it) has no
        # session: getsid() says 0 for kernel threads and, in a container, for every process
        # started from outside its pid namespace, which must never be signalled as the group's.
        sessions = {r.monitor_pid for r in self.ranks if r.monitor_pid and r.monitor_pid > 0}
        pids: set[int] = set()
        for pid in psutil.pids():
            try:
                if os.getsid(pid) in sessions:
                    pids.add(pid)
            except OSError:
                continue
        for r in self.ranks:
            if procs.alive(r.monitor_pid, r.monitor_create_time):
                try:
                    pids.update(c.pid for c in psutil.Process(r.monitor_pid).children(recursive=True))
                    pids.add(r.monitor_pid)
                except psutil.Error:
                    pass
        pids.update(pid for pid, ct in self.seen if procs.alive(pid, ct))
        pids.update(w.pid for w in self.workers.values() if w.pid and procs.alive(w.pid, w.create_time))
        pids.discard(os.getpid())
        return pids

    def _signal_all(self, sig: int) -> set[int]:
        pids = self.member_pids()
        for r in self.ranks:
            if not r.monitor_pid or r.monitor_pid <= 0:
                continue  # killpg(0) would signal the daemon's own process group
            try:
                os.killpg(r.monitor_pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        return pids

    def _reap(self) -> None:
        for r in self.ranks:
            if r.popen is not None:
                r.popen.poll()

    async def teardown(self, grace: float, reason: str) -> None:
        """SIGTERM every process of the group, wait up to `grace`, then SIGKILL the rest.
        `reason` is kept only for a teardown the user asked for (see Core._cancel_group)."""
        if self.teardown_since is None:
            self.teardown_since = time.time()
        self.tearing = True
        log.info("group %s/%s attempt %s: tearing down (%s)", self.run_id, self.stage, self.attempt, reason)
        try:
            await self._teardown(grace)
        finally:
            self.tearing = False

    async def _teardown(self, grace: float) -> None:
        pending = self._signal_all(signal.SIGTERM)
        # A stopped process (SIGSTOP, a debugger's detach) holds SIGTERM pending until it runs
        # again, and would wait out the whole grace for SIGKILL: continue it, as systemd does.
        self._signal_all(signal.SIGCONT)
        deadline = time.monotonic() + grace
        while pending and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            self._reap()
            pending = {p for p in pending if psutil.pid_exists(p) and not _zombie(p)}
        if pending or self.member_pids():
            log.info("group %s/%s attempt %s: SIGKILL after %.1fs grace", self.run_id, self.stage, self.attempt, grace)
            self._signal_all(signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                self._reap()
                if not self.member_pids():
                    break
                await asyncio.sleep(0.02)
        self._reap()
        left = self.member_pids()
        if left:
            log.error("group %s/%s: processes survived SIGKILL: %s", self.run_id, self.stage, sorted(left))


def make_attempt_dir(dir: Path) -> None:
    """Create an attempt's folder, exclusively: a folder that exists holds another run's or
    attempt's files (a database lost or restored reissues ids), and not one byte may mix with them."""
    dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        dir.mkdir()
    except FileExistsError:
        raise FileExistsError(
            errno.EEXIST,
            f"attempt directory {dir} already exists; eyas never writes into another attempt's directory",
        ) from None


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True
