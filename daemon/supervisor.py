"""Rank groups: start N rank processes the way torchrun does, watch them, say why one
failed, and tear the whole group down, descendants included.

Each rank is a `python -m eyas.workers.monitor` session leader whose stdout and stderr are
its own log file, so no byte of rank output passes through the daemon and a daemon restart
never stalls or kills a rank. The monitor records the worker's exit status in
`rank-<r>.exit.json`, which is how a restarted daemon settles ranks that ended while it was
down.

Tensor-parallel workers are ranks too. A vLLM driver rank's engine spawns them (they live in
the driver's session and process tree); eyas's worker extension registers each one at
start-up in `tp-<k>.proc.json`. The group picks these up as extra ranks (role "tp-worker",
numbered world_size + k after the driver ranks), samples them apart from the driver, tears
them down with it, and settles their failures:
- an error record `tp-<k>.error.json` (written inside the worker before vLLM flattens the
  exception into a string for the driver) is that TP rank's failure, at its own time, even
  while the process still runs: the group is torn down at once;
- a worker that dies is a failure only if vLLM's executor, its parent, reported it
  "died unexpectedly (exit code: N)" (read from the driver's log by logsplit.py); a worker
  ending while the engine shuts down (vLLM SIGKILLs stragglers itself) is not.
The root cause is still the earliest failure, so a worker's error, which comes first, wins
over the driver's re-raised `Worker failed with error ''`. The driver's combined log is
split into `tp-<k>.log` and `driver.log` (logsplit.py).

An attempt's directory is created by `spawn` and by nothing else, so no other run's files can
be in it; still, a record is believed only when it is this attempt's (`Group.own_record`): an
exit, done or error file whose pid is not the process it describes, or whose stage or attempt
is another's, is ignored and logged, and the rank is settled by what is known of it otherwise.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from eyas.state import contract, procs, specs

from . import oom
from .logsplit import LogSplitter

log = logging.getLogger("eyas.daemon.supervisor")

# How much of a log's tail is read to find a native crash's stack.
_TAIL_BYTES = 64 * 1024


def free_port() -> int:
    """A free TCP port on loopback for MASTER_PORT, found as torchrun does: bind port 0."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None




def create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def tail_text(path: Path, size: int = _TAIL_BYTES) -> str:
    """The last `size` bytes of a file as text; "" when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - size))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def log_tail(path: Path, max_lines: int = 40) -> str:
    """The end of a rank log; from the last native-crash header when there is one."""
    text = tail_text(path)
    crash = text.rfind("Fatal Python error:")
    if crash >= 0:
        return "\n".join(text[crash:].splitlines()[:200])
    return "\n".join(text.splitlines()[-max_lines:])


@dataclass
class RankExit:
    """How one rank ended, from its exit record, its error file and the monitor's status."""

    rank: int
    pid: int | None
    exit_code: int | None
    signal: int | None
    time: float
    error: dict | None = None
    oom_killed: bool = False
    lost: bool = False
    unexpected: bool = False        # a TP worker whose death vLLM called unexpected
    tp_rank: int | None = None      # set for a TP worker

    @property
    def failed(self) -> bool:
        return (self.lost or self.unexpected or self.signal is not None or (self.exit_code or 0) != 0
                or self.error is not None)

    @property
    def signal_name(self) -> str | None:
        if self.signal is None:
            return None
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"


# How long after a peer's lost-connection error a death by signal still counts as its cause.
PEER_LOSS_WINDOW = 1.0
# What gloo, NCCL and torch.distributed say when the other end of a collective went away.
_PEER_LOSS = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|DistBackendError|"
                        r"DistNetworkError|remote process exited|NCCL communicator was aborted", re.IGNORECASE)


def _failure_time(ex: RankExit) -> float:
    """When a failure happened: its exception's own time if it raised one, else its exit."""
    return float((ex.error or {}).get("time") or ex.time)


def _is_peer_loss(error: dict) -> bool:
    return bool(_PEER_LOSS.search(f"{error.get('type', '')}: {error.get('message', '')}"))


@dataclass
class Rank:
    rank: int
    log_path: Path
    monitor_pid: int
    monitor_create_time: float | None
    popen: subprocess.Popen | None = None   # None when adopted by a restarted daemon
    pid: int | None = None                  # the worker, from rank-<r>.proc.json
    create_time: float | None = None
    device: str | None = None
    exit: RankExit | None = None
    role: str | None = None                 # "driver", "tp-worker"; None for a plain rank
    tp_rank: int | None = None
    started_at: float | None = None
    ended_at: float | None = None           # a TP worker's end, as its pidfd said it


@dataclass
class Group:
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
    tearing: bool = False            # a teardown is in progress: settle only after it ends
    cancel_reason: str | None = None
    oom_before: int | None = None
    metrics_since: float | None = None   # set on re-adoption: samples up to here are stored
    # (pid, create_time) of every process seen in the ranks' trees, fed by the sampler, so
    # that teardown also finds children that left the ranks' sessions.
    seen: set[tuple[int, float]] = field(default_factory=set)
    # Tensor-parallel workers of a vLLM driver (rank 0), by TP rank.
    workers: dict[int, Rank] = field(default_factory=dict)
    splitter: LogSplitter | None = None
    leftovers_ended: bool = False    # the driver ranks ended and their leftovers were torn down
    pidfds: dict[int, int] = field(default_factory=dict)   # TP rank -> pidfd watched by the event loop
    # The hang watchdog (daemon/watchdog.py): seconds of quiet allowed (0: off), seconds a
    # rank may outlive its work or its peers (0: off), when the attempt directory last changed
    # and how it looked; once stuck, the rule's record (with the stacks under "asked" once
    # they are collected: the group is settled only after).
    stall_timeout: float = 0.0
    exit_timeout: float = 0.0
    active_at: float = field(default_factory=time.time)
    activity: tuple = ()
    stuck: dict | None = None
    ignored: set = field(default_factory=set)    # records refused by own_record, each logged once
    # The settlement (daemon/settle.py): what the end was, read once, and when to try again
    # to record it after a write failed (the group stays in memory until it is recorded).
    account: object | None = None
    settle_retry_at: float = 0.0
    settle_retries: int = 0
    settling: bool = False          # its settlement is queued on the store thread

    # -- start -------------------------------------------------------------------------

    @classmethod
    def spawn(cls, *, run_id: int, stage: str, attempt_id: int, attempt: int, dir: Path,
              world_size: int, devices: list[int], output_dir: Path, config_path: Path | None,
              extra_env: dict[str, str] | None = None) -> Group:
        dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            # Exclusively: a folder that exists holds another run's or attempt's files (a
            # database lost or restored reissues ids), and not one byte may mix with them.
            dir.mkdir()
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, f"attempt directory {dir} already exists; eyas never "
                                  "writes into another attempt's directory") from None
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
        return self.devices[r * per:(r + 1) * per]

    def _start_rank(self, r: int, output_dir: Path, config_path: Path | None, extra: dict) -> Rank:
        env = dict(os.environ)
        env.update(
            {contract.RANK: str(r), contract.WORLD_SIZE: str(self.world_size), contract.LOCAL_RANK: str(r),
             contract.LOCAL_WORLD_SIZE: str(self.world_size), contract.MASTER_ADDR: "127.0.0.1",
             contract.MASTER_PORT: str(self.master_port), contract.RUN_ID: str(self.run_id),
             contract.STAGE: self.stage, contract.ATTEMPT: str(self.attempt), contract.ATTEMPT_DIR: str(self.dir),
             contract.OUTPUT_DIR: str(output_dir), "PYTHONUNBUFFERED": "1"}, **extra,
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
                specs.argv(sys.executable), stdin=subprocess.DEVNULL, stdout=fd, stderr=fd,
                env=env, cwd=self.dir, start_new_session=True, close_fds=True,
            )
        finally:
            os.close(fd)
        return Rank(r, log_path, popen.pid, create_time(popen.pid), popen,
                    device=",".join(map(str, devs)) or None)

    # -- watch -------------------------------------------------------------------------

    def _learn_worker(self, rank: Rank) -> bool:
        """Pick up the worker's pid from the monitor's proc file; True when newly learnt."""
        if rank.pid is not None:
            return False
        proc = _read_json(self.dir / contract.rank_file(rank.rank, contract.PROC))
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
        record = _read_json(self.dir / name)
        if record is None:
            return None
        if not isinstance(record, dict):
            record = {"pid": None, "time": None}     # nobody's: refused below, and logged
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
            log.warning("run %s: %s attempt %d: ignoring %s: %s (a leftover of another run or attempt)",
                        self.run_id, self.stage, self.attempt, self.dir / name, why)
        return None

    def rank_error(self, rank: Rank, worker_pid: int | None = None) -> dict | None:
        """rank-<r>.error.json, when this attempt's worker of the rank wrote it (or its monitor,
        which records a runtime that could not start). `worker_pid`: the pid the exit record
        names, where the proc file gave none."""
        worker = rank.pid or worker_pid
        return self.own_record(contract.rank_file(rank.rank, contract.ERROR), {worker, rank.monitor_pid},
                               pid_unknown=worker is None)

    def tp_error(self, worker: Rank) -> dict | None:
        """tp-<k>.error.json, when this attempt's TP worker k wrote it."""
        return self.own_record(contract.tp_file(worker.tp_rank, contract.ERROR), {worker.pid})

    def rank_of(self, number: int) -> Rank:
        """A rank by its number: a driver rank, or a TP worker (world_size + tp_rank)."""
        if number < len(self.ranks):
            return self.ranks[number]
        return self.workers[number - self.world_size]

    # -- tensor-parallel workers ---------------------------------------------------------

    def _learn_tp(self) -> list[Rank]:
        """TP workers that registered since the last pass (tp-<k>.proc.json)."""
        new = []
        for path in self.dir.glob(contract.TP_PROC_GLOB):
            k = contract.tp_rank_of(path.name)
            if k is None:
                continue
            known = self.workers.get(k)
            proc = _read_json(path)
            if not proc or not proc.get("pid"):
                continue
            if known is not None and known.pid == proc["pid"]:
                continue
            d = proc.get("driver_rank") or 0
            driver = self.ranks[d] if isinstance(d, int) and 0 <= d < len(self.ranks) else None
            worker = Rank(self.world_size + k, self.dir / contract.tp_file(k, contract.LOG),
                          driver.monitor_pid if driver else 0, driver.monitor_create_time if driver else None,
                          None, proc["pid"], proc.get("create_time"), proc.get("device"),
                          role="tp-worker", tp_rank=k, started_at=proc.get("time"))
            self.workers[k] = worker
            if driver is not None and driver.role is None:
                driver.role = "driver"
            if self.splitter is None and driver is not None:
                self.splitter = LogSplitter(driver.log_path, self.dir / contract.rank_file(driver.rank, contract.SPLIT))
            new.append(worker)
        return new

    def watch(self, worker: Rank) -> None:
        """Note the moment a TP worker ends, through a pidfd in the daemon's event loop.

        The worker is not the daemon's child (vLLM's EngineCore reaps it), so no exit status
        reaches the daemon; but its end time decides the root cause when the driver fails
        moments later because of it, and a 20 Hz poll can be later than the driver's own
        error record. A pidfd wakes the loop as the process ends. Without a running loop or
        pidfd support, the poll's time is used."""
        try:
            loop = asyncio.get_running_loop()
            fd = os.pidfd_open(worker.pid)
        except (RuntimeError, AttributeError, OSError, TypeError):
            return
        if not procs.alive(worker.pid, worker.create_time):     # the pid was reused, or it is gone already
            os.close(fd)
            return

        def ended() -> None:
            if worker.ended_at is None:
                worker.ended_at = time.time()
            self._unwatch(worker.tp_rank)

        self._unwatch(worker.tp_rank)
        self.pidfds[worker.tp_rank] = fd
        loop.add_reader(fd, ended)

    def _unwatch(self, tp_rank: int) -> None:
        fd = self.pidfds.pop(tp_rank, None)
        if fd is not None:
            try:
                asyncio.get_running_loop().remove_reader(fd)
            except RuntimeError:
                pass
            os.close(fd)

    def close(self) -> None:
        """Stop watching the TP workers (the group is settled)."""
        for k in list(self.pidfds):
            self._unwatch(k)

    def tp_of_pid(self, pid: int) -> int | None:
        """The TP rank of a worker pid; a miss rescans the proc files once (a worker writes
        its proc file before its first log line, so a line can never outrun it for good)."""
        for k, w in self.workers.items():
            if w.pid == pid:
                return k
        for path in self.dir.glob(contract.TP_PROC_GLOB):
            proc = _read_json(path) or {}
            if proc.get("pid") == pid:
                return proc.get("tp_rank")
        return None

    def _poll_tp(self, final: bool = False) -> list[RankExit]:
        exits = []
        if self.splitter is not None:
            self.splitter.pump(self.tp_of_pid, final=final)
            for k, code in self.splitter.died.items():
                w = self.workers.get(k)
                if w is not None and w.exit is not None and not w.exit.unexpected and w.exit.error is None:
                    self._mark_unexpected(w.exit, code)
                    exits.append(w.exit)
        now = time.time()
        for k, w in sorted(self.workers.items()):
            if w.exit is not None:
                continue
            error = self.tp_error(w)
            if error is not None:
                w.exit = RankExit(w.rank, error.get("pid") or w.pid, None, None, float(error.get("time") or now),
                                  error, tp_rank=k)
            elif not procs.alive(w.pid, w.create_time):
                w.exit = RankExit(w.rank, w.pid, None, None, w.ended_at or now, tp_rank=k)
                if self.splitter is not None and k in self.splitter.died:
                    self._mark_unexpected(w.exit, self.splitter.died[k])
            else:
                continue
            exits.append(w.exit)
        return exits

    @staticmethod
    def _mark_unexpected(ex: RankExit, code: int | None) -> None:
        """vLLM's exit code is multiprocessing's: negative for a signal; None when vLLM
        looked before the process was reaped."""
        ex.unexpected = True
        if code is not None and code < 0:
            ex.signal, ex.exit_code = -code, None
        elif code is not None:
            ex.exit_code = code

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
            ex = RankExit(rank.rank, record.get("pid") or rank.pid, record.get("exit_code"),
                          record.get("signal"), float(record.get("time") or now), error)
        elif monitor_rc is not None:
            # The monitor itself ended without a record: killed along with its worker.
            sig = -monitor_rc if monitor_rc < 0 else None
            ex = RankExit(rank.rank, rank.pid or rank.monitor_pid, None if sig else monitor_rc, sig, now, error)
        else:
            ex = RankExit(rank.rank, rank.pid or rank.monitor_pid, None, None,
                          float((error or {}).get("time") or now), error, lost=error is None)
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
        """A rank's own failure, as opposed to the signal eyas sent it while tearing down."""
        if not ex.failed:
            return False
        if self.teardown_since is None:
            return True
        if ex.error is not None:
            return float(ex.error.get("time") or ex.time) < self.teardown_since
        # Seen to end before the teardown began: the rank's own doing, whatever the cause (a
        # bare exit code counts too: a rank that could not write its error file on a full
        # disk is often what started the teardown, and must not be forgotten at settlement).
        return ex.time < self.teardown_since

    def settle_workers(self) -> list[RankExit]:
        """The last word on the TP workers once the driver has ended: read the rest of the
        driver's log (vLLM's death reports) and give every worker an exit."""
        if not self.workers:
            return []
        self._learn_tp()
        exits = self._poll_tp(final=True)
        now = time.time()
        for k, w in self.workers.items():
            if w.exit is None:      # still running after teardown: it was killed with the group
                w.exit = RankExit(w.rank, w.pid, None, None, w.ended_at or now, tp_rank=k)
                exits.append(w.exit)
        self.close()
        return exits

    def failures(self) -> list[RankExit]:
        """The ranks' own failures, earliest first: the first one is the root cause.

        One exception to time order: a peer's lost-connection error just before a death by
        signal is that death's consequence. A death's time is when its monitor's waitpid
        returned, a few ms after the kernel closed the dead rank's sockets, and the
        survivors' collective library reports the closed socket at once, so the effect can
        be stamped before its cause.
        """
        members = list(self.ranks) + [self.workers[k] for k in sorted(self.workers)]
        found = [r.exit for r in members if r.exit is not None and self.counts_as_failure(r.exit)]
        found.sort(key=lambda e: (_failure_time(e), e.rank))
        if found and found[0].error is not None and _is_peer_loss(found[0].error):
            first = _failure_time(found[0])
            for i, e in enumerate(found):
                if e.error is None and e.signal is not None and _failure_time(e) - first <= PEER_LOSS_WINDOW:
                    found.insert(0, found.pop(i))
                    break
        return found

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
                continue    # killpg(0) would signal the daemon's own process group
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


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def describe_failure(group: Group, ex: RankExit, host: str) -> contract.ErrorRecord:
    """The error record of one failed rank. Never empty: an exception keeps its type and
    traceback even with an empty message; a signal death names the signal."""
    rank = group.rank_of(ex.rank)
    tp = {"role": "tp-worker", "tp_rank": ex.tp_rank} if ex.tp_rank is not None else {}
    if ex.error is not None:
        e = ex.error
        path = (contract.tp_file(ex.tp_rank, contract.ERROR) if ex.tp_rank is not None
                else contract.rank_file(ex.rank, contract.ERROR))
        return contract.ErrorRecord(
            rank=ex.rank, pid=e.get("pid", ex.pid), host=e.get("host", host),
            type=e.get("type") or "Exception", message=e.get("message") or "",
            traceback=e.get("traceback") or log_tail(rank.log_path), time=float(e.get("time") or ex.time),
            source="exception", path=str(group.dir / path), **tp,
        )
    tail = log_tail(rank.log_path)
    if ex.tp_rank is not None:
        if ex.signal is not None:
            kind, how = ex.signal_name, f"was killed by {ex.signal_name} (signal {ex.signal})"
        elif ex.exit_code is not None:
            kind, how = "ExitCode", f"exited with code {ex.exit_code}"
        else:
            kind, how = "WorkerDied", "ended (its exit status was not known yet when vLLM looked)"
        return contract.ErrorRecord(
            rank=ex.rank, pid=ex.pid, host=host, type=kind,
            message=f"TP rank {ex.tp_rank} (pid {ex.pid}) {how}: vLLM's executor reported that it died unexpectedly",
            traceback=tail, time=ex.time, source="signal" if ex.signal else "exit", path=str(rank.log_path), **tp)
    if ex.lost:
        kind, msg, source = "Lost", (
            f"rank {ex.rank} (pid {ex.pid}) ended while the daemon was down and left no exit record"
        ), "lost"
    elif ex.signal is not None:
        kind = ex.signal_name
        msg = f"rank {ex.rank} (pid {ex.pid}) was killed by {kind} (signal {ex.signal})"
        if ex.oom_killed:
            msg += ": the kernel's OOM killer ended it (out of memory)"
        source = "signal"
    else:
        kind, msg, source = "ExitCode", (
            f"rank {ex.rank} (pid {ex.pid}) exited with code {ex.exit_code} without a Python exception"
        ), "exit"
    return contract.ErrorRecord(rank=ex.rank, pid=ex.pid, host=host, type=kind, message=msg, traceback=tail,
                                time=ex.time, source=source, path=str(rank.log_path))
