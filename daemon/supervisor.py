"""Rank groups: start N rank processes the way torchrun does, watch them, say why one
failed, and tear the whole group down, descendants included.

Each rank is a `python -m eyas.workers.monitor` session leader whose stdout and stderr are
its own log file, so no byte of rank output passes through the daemon and a daemon restart
never stalls or kills a rank. The monitor records the worker's exit status in
`rank-<r>.exit.json`, which is how a restarted daemon settles ranks that ended while it was
down.
"""

from __future__ import annotations

import asyncio
import json
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

from eyas.workers import specs

from . import oom

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


def _alive(pid: int | None, create_time: float | None) -> bool:
    """Is the process (pid, create_time) still running? A recycled pid is not."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if create_time is not None and abs(proc.create_time() - create_time) > 0.01:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def log_tail(path: Path, max_lines: int = 40) -> str:
    """The end of a rank log; from the last native-crash header when there is one."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
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

    @property
    def failed(self) -> bool:
        return self.lost or self.signal is not None or (self.exit_code or 0) != 0 or self.error is not None

    @property
    def signal_name(self) -> str | None:
        if self.signal is None:
            return None
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"


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

    # -- start -------------------------------------------------------------------------

    @classmethod
    def spawn(cls, *, run_id: int, stage: str, attempt_id: int, attempt: int, dir: Path,
              world_size: int, devices: list[int], output_dir: Path, config_path: Path | None,
              extra_env: dict[str, str] | None = None) -> "Group":
        dir.mkdir(parents=True, exist_ok=True)
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
            RANK=str(r), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(self.world_size), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.master_port), EYAS_RUN_ID=str(self.run_id), EYAS_STAGE=self.stage,
            EYAS_ATTEMPT=str(self.attempt), EYAS_ATTEMPT_DIR=str(self.dir),
            EYAS_OUTPUT_DIR=str(output_dir), PYTHONUNBUFFERED="1", **extra,
        )
        if config_path:
            env["EYAS_CONFIG"] = str(config_path)
        devs = self.rank_devices(r)
        if devs:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devs))
        log_path = self.dir / f"rank-{r}.log"
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
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
        proc = _read_json(self.dir / f"rank-{rank.rank}.proc.json")
        if proc and proc.get("monitor_pid") == rank.monitor_pid:
            rank.pid, rank.create_time = proc.get("pid"), proc.get("create_time")
            return True
        return False

    def poll(self) -> tuple[list[Rank], list[RankExit]]:
        """Check every live rank; returns (ranks whose worker pid was just learnt, new exits)."""
        learnt, exits = [], []
        for rank in self.ranks:
            if rank.exit is not None:
                continue
            if self._learn_worker(rank):
                learnt.append(rank)
            if rank.popen is not None:
                rc = rank.popen.poll()
                if rc is None:
                    continue
            elif _alive(rank.monitor_pid, rank.monitor_create_time):
                continue
            else:
                rc = None
            self._learn_worker(rank)
            rank.exit = self._settle(rank, rc)
            exits.append(rank.exit)
        return learnt, exits

    def _settle(self, rank: Rank, monitor_rc: int | None) -> RankExit:
        record = _read_json(self.dir / f"rank-{rank.rank}.exit.json")
        error = _read_json(self.dir / f"rank-{rank.rank}.error.json")
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
        return ex.time < self.teardown_since and ex.signal is not None

    def failures(self) -> list[RankExit]:
        """The ranks' own failures, earliest first: the first one is the root cause."""
        found = [r.exit for r in self.ranks if r.exit is not None and self.counts_as_failure(r.exit)]
        return sorted(found, key=lambda e: (float((e.error or {}).get("time") or e.time), e.rank))

    # -- tear down ---------------------------------------------------------------------

    def member_pids(self) -> set[int]:
        """Every live process of the group: the ranks' sessions, their process trees, and
        any descendant the sampler saw that has since left them."""
        sessions = {r.monitor_pid for r in self.ranks}
        pids: set[int] = set()
        for pid in psutil.pids():
            try:
                if os.getsid(pid) in sessions:
                    pids.add(pid)
            except OSError:
                continue
        for r in self.ranks:
            if _alive(r.monitor_pid, r.monitor_create_time):
                try:
                    pids.update(c.pid for c in psutil.Process(r.monitor_pid).children(recursive=True))
                    pids.add(r.monitor_pid)
                except psutil.Error:
                    pass
        pids.update(pid for pid, ct in self.seen if _alive(pid, ct))
        pids.discard(os.getpid())
        return pids

    def _signal_all(self, sig: int) -> set[int]:
        pids = self.member_pids()
        for r in self.ranks:
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


def describe_failure(group: Group, ex: RankExit, host: str) -> dict:
    """The error record of one failed rank. Never empty: an exception keeps its type and
    traceback even with an empty message; a signal death names the signal."""
    rank = group.ranks[ex.rank]
    if ex.error is not None:
        e = ex.error
        return {
            "rank": ex.rank, "pid": e.get("pid", ex.pid), "host": e.get("host", host),
            "type": e.get("type") or "Exception", "message": e.get("message") or "",
            "traceback": e.get("traceback") or log_tail(rank.log_path), "time_": float(e.get("time") or ex.time),
            "source": "exception", "path": str(group.dir / f"rank-{ex.rank}.error.json"),
        }
    tail = log_tail(rank.log_path)
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
    return {"rank": ex.rank, "pid": ex.pid, "host": host, "type": kind, "message": msg,
            "traceback": tail, "time_": ex.time, "source": source, "path": str(rank.log_path)}
