"""The daemon's core: runs and stages, device queues, controls, and supervision of the
live rank groups. It answers the socket API (as the server's handler) and keeps SQLite
up to date; it is the only writer of the store.

Every read and write of the store runs on the store thread (daemon/storewriter.py), never
on the event loop: a function `fn(db)` is one transaction there. The loop waits for one
only where the answer decides what it does next (a request's reply, the start of an
attempt, which must be recorded before its ranks are spawned); the rest (rank exits, pids,
metrics) is queued and written in order, so a database locked by another process delays
the record and never the supervision."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from sqlite_utils.db import NotFoundError

from eyas.state import contract, machine, paths, specs, store
from eyas.state import runconfig as run_config

from . import diskfull, intent, oom, protocol, settle, stacks, watchdog
from . import native as native_stacks
from .logsplit import LogSplitter
from .protocol import ProtocolError
from .sampler import RankRef, Sampler
from .settle import who as _who
from .storewriter import StoreBusy, Writer
from .supervisor import Group, Rank, RankExit, _read_json, free_port

log = logging.getLogger("eyas.daemon.core")

SAMPLE_PERIOD = 1.0
# Retention (README): raw samples older than a week go, and never more than 2M rows;
# the history listings read roll-ups, which are kept forever.
METRICS_MAX_AGE = 7 * 24 * 3600.0
METRICS_MAX_ROWS = 2_000_000
PRUNE_PERIOD = 600.0
# How long a request waits for the store when another process holds the database locked,
# before its answer is "store busy" (and nothing of it was done); clients wait longer.
OP_TIMEOUT = 5.0
# How long a stop waits for its intent to be recorded before signalling anyway (the
# settlement, written once the lock goes, carries the reason from memory).
INTENT_WAIT = 1.0
SHUTDOWN_WAIT_S = 30.0


@dataclass
class _Start:
    """An attempt the scheduler recorded as started: what its ranks are spawned with."""

    run_id: int
    stage: str
    cfg: dict
    attempt_id: int
    number: int
    attempt_dir: Path
    world_size: int
    devices: list[int]
    output_dir: Path
    run_dir: Path


class Core:
    def __init__(self, db, home: Path, *, grace: float = 10.0, sampler: Sampler | None = None,
                 publish=None, wants=None):
        self.db = db            # the store thread's connection: used only inside store jobs
        self.store = Writer(db, on_busy=self._store_changed)
        self.home = home
        self.grace = grace
        self.sampler = sampler or Sampler()
        self.publish = publish or (lambda topic, data: None)
        self.wants = wants or (lambda topic: False)
        self.host = socket.gethostname()
        self.groups: dict[int, Group] = {}           # attempt id -> live group
        # A full state directory (daemon/diskfull.py): no attempt starts while it lasts.
        self.disk = diskfull.Condition(home)
        self.served_socket: Path | None = None   # set by the daemon's main as it binds (and rebinds)
        self.disk.on_change = self._disk_changed
        # The state events of the store job running on this thread: published once it commits.
        self._local = threading.local()
        self._planning = False           # a scheduling pass is recording or spawning
        self._decide = asyncio.Lock()    # held while the scheduler plans and spawns, and by a stop
        self._metrics_lock = threading.Lock()
        self._metrics_buf: dict | None = None      # samples waiting for the store thread
        self.waiting: dict[int, str] = {}            # run id -> why it waits
        self.started = time.time()
        self.stopping = False
        self._dirty = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._last_sample = 0.0
        self._last_prune = 0.0
        self.stage_live: dict[tuple[int, str], dict] = {}   # latest roll-up per running stage

    # -- recording, with events out to subscribers -----------------------------------------

    def _emit_state(self, run_id: int, entity: str, new: str, reason: str, stage=None, attempt=None) -> None:
        event = {"run_id": run_id, "stage": stage, "attempt": attempt, "entity": entity,
                 "to_state": new, "reason": reason, "time": time.time()}
        held = getattr(self._local, "held", None)
        if held is not None:        # inside a store job: announced once it has committed
            held.append(event)
        else:
            self.publish("state", event)

    def transaction(self):
        """A nested transaction inside a store job (a savepoint): the parts of a decision that
        must happen whole, or not at all, within the job's own transaction."""
        return self.db.atomic()

    def _job(self, fn):
        """`fn(db)` as a store job that also returns the state events it emitted, so that they
        go out to the subscribers only once it committed, never for a rolled-back change."""
        def run(db):
            self._local.held = []
            try:
                return fn(db), self._local.held
            finally:
                self._local.held = None
        return run

    def _announce(self, events: list[dict]) -> None:
        for event in events:
            self.publish("state", event)

    async def write(self, fn, what: str, *, timeout: float | None = None):
        """Run `fn(db)` as one transaction on the store thread and return its result; with
        `timeout`, StoreBusy when the database stayed locked that long (nothing was done)."""
        result, events = await self.store.call(self._job(fn), what, timeout=timeout)
        self._announce(events)
        return result

    def submit(self, fn, what: str) -> asyncio.Future:
        """Queue `fn(db)` now, in order with every write queued after it; the future holds its
        result (its state events announced) or its exception."""
        inner = self.store.submit(self._job(fn), what)
        outer = asyncio.get_running_loop().create_future()

        def finished(f: asyncio.Future) -> None:
            if f.cancelled():
                outer.cancel()
            elif f.exception() is not None:
                outer.set_exception(f.exception())
            else:
                result, events = f.result()
                self._announce(events)
                outer.set_result(result)
        inner.add_done_callback(finished)
        return outer

    def write_later(self, fn, what: str) -> asyncio.Future:
        """Queue `fn(db)` without waiting for it: a write that a later one repeats or that is
        worth less than going on (a pid, an exit that the settlement writes again, metrics).
        A full disk is noted on the condition; other errors are logged (eyas's own bugs)."""
        future = self.submit(fn, what)

        def finished(f: asyncio.Future) -> None:
            exc = None if f.cancelled() else f.exception()
            if exc is None:
                return
            if diskfull.is_full(exc):
                self.disk.mark(what, exc)
            else:
                log.error("%s failed", what, exc_info=exc)
        future.add_done_callback(finished)
        return future

    def _store_changed(self, busy) -> None:
        """A daemon-wide state event (no run): another process holds the database locked, or released it."""
        status = self.store.status()
        self.publish("state", {"run_id": None, "stage": None, "attempt": None, "entity": "store",
                               "to_state": "busy" if busy else "ok", "busy": status,
                               "reason": (f"store busy: waiting for a lock on eyas.db ({busy.what})" if busy
                                          else "the store is free again"), "time": time.time()})
        if busy is None:
            self.poke()

    def _move_run(self, run_id: int, new: str, reason: str, **fields) -> None:
        store.move_run(self.db, run_id, new, reason, **fields)
        self._emit_state(run_id, "run", new, reason)

    def _move_stage(self, run_id: int, stage: str, new: str, reason: str, **fields) -> None:
        store.move_stage(self.db, run_id, stage, new, reason, **fields)
        self._emit_state(run_id, "stage", new, reason, stage=stage)

    def _disk_changed(self, full: dict | None) -> None:
        """A daemon-wide state event (no run): the state directory became full, or has space again."""
        self.publish("state", {"run_id": None, "stage": None, "attempt": None, "entity": "daemon",
                               "to_state": "full" if full else "ok", "full": full,
                               "reason": full["what"] if full else "the state directory has space again",
                               "time": time.time()})

    def poke(self) -> None:
        self._dirty.set()

    # -- the socket API ----------------------------------------------------------------------

    async def handle(self, req: protocol.Request, conn=None) -> Any:
        op = getattr(self, f"op_{req.op}", None)
        if op is None:
            raise ProtocolError(protocol.UNKNOWN_OP, f"op {req.op!r} is not served by this daemon")
        try:
            inspect.signature(op).bind(**req.args)
        except TypeError as exc:
            params = ", ".join(inspect.signature(op).parameters) or "none"
            raise ProtocolError(protocol.BAD_REQUEST, f"{req.op}: {exc} (args: {params})") from None
        try:
            result = op(**req.args)
            if asyncio.iscoroutine(result):
                result = await result
            return result
        except ProtocolError:
            raise
        except machine.IllegalTransition as exc:
            raise ProtocolError(protocol.ILLEGAL, str(exc)) from None
        except store.NotFound as exc:
            raise ProtocolError(protocol.NOT_FOUND, str(exc)) from None
        except StoreBusy as exc:
            raise ProtocolError(protocol.STORE_BUSY, str(exc)) from None
        except Exception as exc:
            if not diskfull.is_full(exc):
                raise
            self.disk.mark(f"serving {req.op}", exc)
            raise ProtocolError(protocol.STATE_FULL, f"state directory full: {self.disk.state.what}; "
                                f"{req.op} was not done (free space in {self.home} and try again)") from None
        # Anything else is eyas's own bug: the server logs its traceback and replies
        # "internal", rather than passing it off as the caller's bad request.
        finally:
            self.poke()

    def op_ping(self) -> dict:
        return {"pid": os.getpid(), "version": protocol.VERSION}

    def op_status(self) -> dict:
        """Served from memory alone, so that it answers whatever the store is doing."""
        active = []
        for g in self.groups.values():
            live = self.stage_live.get((g.run_id, g.stage), {})
            active.append({"run_id": g.run_id, "stage": g.stage, "attempt": g.attempt,
                           "world_size": g.world_size, "devices": g.devices,
                           "pids": [r.pid or r.monitor_pid for r in g.ranks],
                           "tok_s": live.get("tok_s"), "eta_s": live.get("eta_s"),
                           "progress": live.get("progress")})
        return {"pid": os.getpid(), "uptime": time.time() - self.started, "home": str(self.home),
                # The socket the server serves (daemon.main sets it; it moves when rebound).
                "socket": str(self.served_socket or paths.socket_path(self.home, create=False)),
                "database": str(paths.db_path(self.home)),
                # `waiting` copied at once (one C call): the store thread edits it.
                "active": active, "waiting": {str(k): v for k, v in dict(self.waiting).items()},
                "gpu": self.sampler.gpu_available, "full": self.disk.status(),
                "store_busy": self.store.status()}

    @staticmethod
    def _run_id(run: Any) -> int:
        if isinstance(run, bool) or not isinstance(run, (int, str)) or not str(run).strip().isdigit():
            raise ProtocolError(protocol.BAD_REQUEST, f"run: {run!r} is not a run id (a whole number)")
        return int(run)

    @staticmethod
    def _run_row(db, run_id: int) -> dict:
        try:
            return db["runs"].get(run_id)
        except NotFoundError:
            raise store.NotFound(f"no run {run_id}") from None

    async def _request(self, fn, what: str):
        """A request's transaction: its answer, or StoreBusy after OP_TIMEOUT of a held lock."""
        return await self.write(fn, what, timeout=OP_TIMEOUT)

    async def op_submit(self, config_path: str) -> dict:
        try:
            cfg = run_config.load(Path(config_path))
        except run_config.ConfigError as exc:
            raise ProtocolError(protocol.INVALID_CONFIG, "\n".join(exc.errors)) from None
        data = cfg.to_dict()
        stages = []
        for name in cfg.pipeline:
            max_restarts, _backoff, _options = run_config.stage_settings(cfg, name)
            stages.append({"name": name, "max_restarts": max_restarts,
                           "world_size": run_config.stage_world_size(cfg, name)})
        model = Path(cfg.target.path).name if getattr(cfg.target, "path", None) else None
        claimed: list[Path] = []

        def create(db):
            # The folder first, then the row that records it: the id is one no folder on disk
            # has (paths.claim_run_dir), whatever the database remembers.
            last = db.execute("SELECT max(id) FROM runs").fetchone()[0] or 0
            run_id, run_dir = paths.claim_run_dir(last + 1, self.home)
            claimed.append(run_dir)
            output_dir = Path(cfg.output_dir) if cfg.output_dir else run_dir / "out"
            data["output_dir"] = str(output_dir)
            (run_dir / "config.json").write_text(json.dumps(data, indent=2))
            store.create_run(db, name=cfg.name, model=model, stages=stages, config=data,
                             config_path=str(Path(config_path).absolute()), output_dir=str(output_dir),
                             run_id=run_id, dir=str(run_dir))
            self._emit_state(run_id, "run", "pending", "submitted")
            return run_id, output_dir

        try:
            run_id, output_dir = await self._request(create, f"recording the submitted run {cfg.name}")
        except BaseException:
            # No run records these folders (a full disk, a held lock): none is left behind
            # for the next daemon to warn about.
            for run_dir in claimed:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        for run_dir in claimed[:-1]:        # claimed by a try that met the lock
            shutil.rmtree(run_dir, ignore_errors=True)
        log.info("run %s submitted: %s (%s)", run_id, cfg.name, ", ".join(cfg.pipeline))
        return {"run_id": run_id, "stages": list(cfg.pipeline), "output_dir": str(output_dir)}

    def _stage_or_default(self, db, run_id: int, stage: str | None, states: tuple[str, ...]) -> str:
        if stage:
            store.stage_row(db, run_id, stage)
            return stage
        for row in db["stages"].rows_where("run_id = ?", [run_id], order_by="position"):
            if row["state"] in states:
                return row["name"]
        raise machine.IllegalTransition(f"run {run_id} has no stage that is {' or '.join(states)}")

    def _group_of(self, run_id: int, stage: str | None = None) -> Group | None:
        return next((g for g in self.groups.values()
                     if g.run_id == run_id and (stage is None or g.stage == stage)), None)

    @contextlib.asynccontextmanager
    async def _deciding(self, what: str):
        """Hold off the scheduler: what is in memory (the live groups) and in the store agree
        while a stop looks at both."""
        try:
            await asyncio.wait_for(self._decide.acquire(), OP_TIMEOUT)
        except TimeoutError:
            raise StoreBusy(self.store.busy_text(what)) from None
        try:
            yield
        finally:
            self._decide.release()

    async def op_stop(self, run: int, stage: str | None = None) -> dict:
        run_id = self._run_id(run)
        async with self._deciding(f"stopping run {run_id}"):
            row = await self._request(lambda db: self._run_row(db, run_id), f"reading run {run_id}")
            if stage is None:
                machine.check("run", row["state"], "cancelled", f"run {run_id}")
            group = self._group_of(run_id, stage)
            if group is not None:
                await self._cancel_group(group, "stopped by the user")
                return {"run_id": run_id, "stage": group.stage, "stopping": True}

            def stop(db):
                row = self._run_row(db, run_id)
                if stage is None:
                    machine.check("run", row["state"], "cancelled", f"run {run_id}")
                target = stage or self._stage_or_default(db, run_id, None, ("running", "pending"))
                srow = store.stage_row(db, run_id, target)
                # The stage and its run together (a pending restart goes with the move).
                self._move_stage(run_id, target, "cancelled", "stopped by the user")
                if srow["state"] == "running" or stage is None:
                    self._finish_run(db, run_id, "cancelled", f"stage {target} stopped by the user")
                return target

            target = await self._request(stop, f"stopping run {run_id}")
        return {"run_id": run_id, "stage": target, "stopping": False}

    async def op_retry(self, run: int, stage: str | None = None) -> dict:
        run_id = self._run_id(run)

        def retry(db):
            row = self._run_row(db, run_id)
            if row["state"] not in ("pending", "running"):
                machine.check("run", row["state"], "pending", f"run {run_id}")
            name = self._stage_or_default(db, run_id, stage, ("failed", "cancelled"))
            # Both or neither: a pending stage of a failed run never starts.
            self._move_stage(run_id, name, "pending", "retry requested", restarts=0)
            if row["state"] in ("failed", "cancelled"):
                self._move_run(run_id, "pending", f"retry of {name} requested")
            return name

        return {"run_id": run_id, "stage": await self._request(retry, f"retrying run {run_id}")}

    async def op_skip(self, run: int, stage: str) -> dict:
        run_id = self._run_id(run)

        def skip(db):
            self._run_row(db, run_id)
            srow = store.stage_row(db, run_id, stage)
            if srow["state"] == "running":
                raise machine.IllegalTransition(
                    f"stage {stage} of run {run_id} is running; stop it first (eyas stop {run_id} --stage {stage})")
            self._move_stage(run_id, stage, "skipped", "skipped by the user")

        await self._request(skip, f"skipping {stage} of run {run_id}")
        return {"run_id": run_id, "stage": stage}

    async def op_stacks(self, run: int, stage: str | None = None, native: bool = True) -> dict:
        """Ask the live ranks of the run's running stage to write their Python stacks to their
        logs, and with `native`, return those and every live process's native stacks (py-spy) in
        the reply. Without it the reply comes at once (the TUI follows the logs instead)."""
        run_id = self._run_id(run)
        group = self._group_of(run_id, stage)
        if group is None:
            # Only to tell "no such run" from "nothing running"; a live group needs no store.
            await self._request(lambda db: self._run_row(db, run_id), f"reading run {run_id}")
            what = f"stage {stage} of run {run_id} is not running" if stage else f"run {run_id} has no running stage"
            raise machine.IllegalTransition(f"{what}: only live ranks have stacks "
                                            f"(a failed rank's traceback: eyas errors {run_id})")
        members = [*group.ranks, *group.workers.values()]
        ranks = (await stacks.collect(members, native_timeout=native_stacks.INTERACTIVE_TIMEOUT) if native
                 else stacks.request(members))
        log.info("run %s: %s attempt %d: stacks requested from %d ranks", run_id, group.stage, group.attempt,
                 sum("offset" in r for r in ranks))
        return {"run_id": run_id, "stage": group.stage, "attempt": group.attempt, "ranks": ranks}

    async def op_resume(self, run: int) -> dict:
        run_id = self._run_id(run)

        def resume(db):
            row = self._run_row(db, run_id)
            machine.check("run", row["state"], "pending", f"run {run_id}")
            again = []
            for s in db["stages"].rows_where("run_id = ? and state in ('failed','cancelled')", [run_id]):
                self._move_stage(run_id, s["name"], "pending", "run resumed", restarts=0)
                again.append(s["name"])
            self._move_run(run_id, "pending", "resumed by the user")
            return again

        return {"run_id": run_id, "stages": await self._request(resume, f"resuming run {run_id}")}

    async def op_shutdown(self, grace: float | None = None) -> dict:
        asyncio.get_running_loop().call_soon(lambda: self._spawn_task(self.shutdown(grace)))
        return {"stopping": True, "active": len(self.groups)}

    # -- scheduling ----------------------------------------------------------------------

    def _held_devices(self) -> dict[int, int]:
        return {d: g.run_id for g in self.groups.values() for d in g.devices}

    def _devices_for(self, cfg: dict, stage: str, world_size: int,
                     held: dict[int, int] | None = None) -> list[int] | None:
        """The GPUs a stage needs, or None when they are busy. [] means CPU only."""
        wanted = cfg.get("resources", {}).get("devices", "auto")
        held = self._held_devices() if held is None else held
        if wanted == "cpu" or not specs.STAGES[stage].gpus:
            return []
        if isinstance(wanted, list):
            return None if any(d in held for d in wanted) else list(wanted)
        count = self.sampler.gpu.device_count() if self.sampler.gpu_available else 0
        if count == 0:
            return []
        extract = cfg.get("extract", {})
        per_rank = 1
        if stage == "extract" and extract.get("backend") == "vllm":
            per_rank = extract.get("tensor_parallel_size", 1)
        elif stage == "evaluate":       # vLLM at the run's TP size, target and draft on every GPU
            per_rank = (cfg.get("evaluate") or {}).get("tensor_parallel_size") or extract.get("tensor_parallel_size", 1)
        need = world_size * per_rank
        free = [d for d in range(count) if d not in held]
        return free[:need] if len(free) >= need else None

    def _finish_run(self, db, run_id: int, state: str, reason: str, now: float | None = None) -> None:
        row = db["runs"].get(run_id)
        if row["state"] == state:
            return
        if row["state"] == "pending" and state in ("succeeded",):
            self._move_run(run_id, "running", "started", now=now)
        self._move_run(run_id, state, reason, now=now)
        self.waiting.pop(run_id, None)

    def schedule(self) -> None:
        """Start what can start: the next stage of each run, queued behind device holders.
        Nothing starts while the state directory is full or the store is held by another
        process, and a running stage without a live group starts again only when the store
        holds its restart's due time (intent.py)."""
        if self.stopping or self.disk.full or self.store.busy is not None or self._planning:
            return
        self._planning = True
        self._spawn_task(self._schedule())

    async def _schedule(self) -> None:
        try:
            async with self._decide:
                # What is live now; only this pass adds groups, so the snapshot errs on the
                # side of waiting if a group ends while the plan is being recorded.
                live = {g.run_id for g in self.groups.values()}
                held = self._held_devices()
                starts = await self.write(lambda db: self._plan(db, live, held, time.time()), "scheduling")
                for start in starts:
                    self._spawn_attempt(start)
        except Exception as exc:  # noqa: BLE001 - the next pass tries again
            if diskfull.is_full(exc):
                self.disk.mark("scheduling", exc)
            else:
                log.exception("scheduling pass failed")
        finally:
            self._planning = False

    def _plan(self, db, live: set[int], held: dict[int, int], now: float) -> list[_Start]:
        """On the store thread: finish what has ended and record the start of what can start,
        each start before its ranks exist (a restarted daemon finds the attempt, or nothing)."""
        starts = []
        for run in db["runs"].rows_where("state in ('pending','running')", order_by="created_at, id"):
            run_id = run["id"]
            if run_id in live:
                continue
            cfg = json.loads(run["config_json"] or "{}")
            for s in db["stages"].rows_where("run_id = ?", [run_id], order_by="position"):
                if s["state"] in ("succeeded", "skipped"):
                    continue
                if s["state"] in ("failed", "cancelled"):
                    self._finish_run(db, run_id, s["state"], f"stage {s['name']} {s['state']}")
                    break
                due = s["restart_at"]
                if s["state"] == "running" and due is None:
                    # No policy called for another attempt: the record of the last one is
                    # not written yet, or a restart was refused; never start one unasked.
                    break
                if due is not None and due > now:
                    break
                start = self._record_start(db, run, cfg, s, held)
                if start is not None:
                    starts.append(start)
                    held.update({d: run_id for d in start.devices})
                break
            else:
                self._finish_run(db, run_id, "succeeded", "every stage succeeded or was skipped")
        return starts

    def _record_start(self, db, run: dict, cfg: dict, s: dict, held: dict[int, int]) -> _Start | None:
        run_id, stage = run["id"], s["name"]
        world_size = s["world_size"] or 1
        devices = self._devices_for(cfg, stage, world_size, held)
        if devices is None:
            holders = sorted({str(r) for r in held.values()})
            why = f"waiting for devices held by run {', '.join(holders)}"
            if self.waiting.get(run_id) != why:
                self.waiting[run_id] = why
                db["runs"].update(run_id, {"reason": why})
                self._emit_state(run_id, "run", run["state"], why)
            return None
        self.waiting.pop(run_id, None)
        number = (s["attempts"] or 0) + 1
        # Everything under the run's recorded folder, never one rebuilt from its id; a new
        # attempt's folder is one that does not exist yet (Group.spawn creates it exclusively).
        run_dir = paths.run_dir(run, self.home)
        attempt_dir = paths.unused(run_dir / stage / f"attempt-{number}")
        output_dir = Path(run["output_dir"] or run_dir / "out")
        output_dir.mkdir(parents=True, exist_ok=True)
        # The run's, the stage's and the attempt's start in one transaction, before any spawn.
        if run["state"] == "pending":
            self._move_run(run_id, "running", f"starting {stage}")
        if s["state"] == "pending":
            self._move_stage(run_id, stage, "running", "started")
        attempt_id, number = store.new_attempt(db, run_id, stage, dir=str(attempt_dir),
                                               world_size=world_size, devices=devices)
        return _Start(run_id, stage, cfg, attempt_id, number, attempt_dir, world_size, devices, output_dir, run_dir)

    def _spawn_attempt(self, st: _Start) -> None:
        """Start the ranks of an attempt whose start is recorded, and record them."""
        run_id, stage, attempt_id, number = st.run_id, st.stage, st.attempt_id, st.number
        try:
            group = Group.spawn(run_id=run_id, stage=stage, attempt_id=attempt_id, attempt=number,
                                dir=st.attempt_dir, world_size=st.world_size, devices=st.devices,
                                output_dir=st.output_dir,
                                config_path=st.run_dir / "config.json",
                                # Each rank's monitor bounds its log by this (state/logcut.py).
                                extra_env={contract.LOG_MAX_MB: f"{_log_max_mb(st.cfg, stage):g}"})
        except OSError as exc:
            # The daemon could not even start the processes: that is the root cause. (Read
            # here: `exc` is unbound once the except clause ends, before the job runs.)
            now, kind, text = time.time(), type(exc).__name__, str(exc)

            def failed(db):
                store.record_error(db, attempt_id, root_cause=True, **contract.ErrorRecord(
                    type=kind, message=text, traceback="", time=now, source="spawn").fields())
                store.move_attempt(db, attempt_id, "failed", f"could not start ranks: {text}", now=now)
                self._move_stage(run_id, stage, "failed", f"could not start ranks: {text}", now=now)

            self.write_later(failed, f"recording that run {run_id} {stage} attempt {number} could not start")
            return
        # Supervised from here on, whether or not its rows can be written (a full disk): a
        # restarted daemon finds the ranks by their proc files or environment (intent.py).
        _set_bounds(group, st.cfg)
        self.groups[attempt_id] = group
        now = time.time()
        ranks = [(r.rank, r.monitor_pid, r.monitor_create_time, r.device, str(r.log_path)) for r in group.ranks]

        def record(db):
            db["attempts"].update(attempt_id, {"master_port": group.master_port})
            for rank, mpid, mct, device, log_path in ranks:
                store.upsert_rank(db, attempt_id, rank, monitor_pid=mpid, monitor_create_time=mct, host=self.host,
                                  device=device, state="running", started_at=now, log_path=log_path)

        self.write_later(record, f"recording the ranks of run {run_id} {stage} attempt {number}")
        self._emit_state(run_id, "attempt", "running", f"attempt {number} started", stage=stage, attempt=number)
        log.info("run %s: %s attempt %s started with %s ranks (devices %s)", run_id, stage, number,
                 st.world_size, st.devices or "cpu")

    # -- supervision ---------------------------------------------------------------------

    def _spawn_task(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _record_stop(self, group: Group, reason: str) -> asyncio.Future:
        """Queued before any signal (intent.py): a daemon killed during the teardown is
        followed by one that settles the attempt as cancelled. On a full disk or a held lock
        the stop still happens (the disk may be full because of this very run); its
        settlement, written after this, carries the reason."""
        now = time.time()
        return self.write_later(lambda db: store.record_cancel(db, group.attempt_id, reason, now=now),
                                f"recording the stop of run {group.run_id} {group.stage} in eyas.db")

    async def _cancel_group(self, group: Group, reason: str) -> None:
        """End a live group on purpose: record why (waiting a moment for it), then signal."""
        if group.teardown_since is None and group.cancel_reason is None:
            group.cancel_reason = reason
            recorded = self._record_stop(group, reason)
            await asyncio.wait({recorded}, timeout=INTENT_WAIT)
            if group.teardown_since is None:
                self._spawn_task(group.teardown(self.grace, reason))

    def supervise(self) -> None:
        """Check every group: record exits, tear down on the first failure, settle the end.
        Nothing here waits for the store: the writes are queued, the teardown starts at once."""
        for attempt_id, group in list(self.groups.items()):
            learnt, exits = group.poll()
            for r in learnt:
                if r.role == "tp-worker":
                    group.watch(r)
                    self._record_worker(group, r)
                else:
                    pid, create_time = r.pid, r.create_time
                    self.write_later(lambda db, a=attempt_id, r=r.rank, p=pid, c=create_time:
                                     store.upsert_rank(db, a, r, pid=p, create_time=c),
                                     f"recording rank {r.rank}'s pid in eyas.db")
            for ex in exits:
                self._record_exit(group, ex)
            if group.teardown_since is None and any(group.counts_as_failure(e) for e in exits):
                first = group.failures()[0]
                self._spawn_task(group.teardown(self.grace, f"{_who(first)} failed"))
            if group.settling:
                continue
            if not group.alive and not group.tearing and not (group.collecting and group.cancel_reason is None):
                if group.workers and not group.leftovers_ended:
                    # The driver ended: its engine's processes end with it, whatever they do.
                    group.leftovers_ended = True
                    if group.member_pids():
                        self._spawn_task(group.teardown(self.grace, "the driver rank ended"))
                        continue
                self._settle_group(group)

    def watch_hangs(self, now: float) -> None:
        """Start ending every group the watchdog finds stuck (daemon/watchdog.py)."""
        for group in watchdog.check(list(self.groups.values()), now):
            why = watchdog.summary(group)
            log.warning("run %s: %s attempt %d %s", group.run_id, group.stage, group.attempt, why)
            self._emit_state(group.run_id, "stage", "running", why, stage=group.stage, attempt=group.attempt)
            self.record_stuck(group)         # queued before any signal (intent.py)
            self._spawn_task(watchdog.end(group, self.grace, self.record_stuck))

    def record_stuck(self, group: Group) -> None:
        """Write the watchdog's finding (and, once collected, the stacks) on its attempt."""
        stuck = dict(group.stuck)       # as it is now: the loop goes on filling it in
        self.write_later(lambda db: store.record_stuck(db, group.attempt_id, stuck),
                         f"recording run {group.run_id} {group.stage}'s {stuck['kind']} in eyas.db")

    def _record_worker(self, group: Group, w: Rank) -> None:
        """A TP worker registered: a rank of the attempt from now on; its driver is one too."""
        drivers = [r.rank for r in group.ranks if r.role == "driver"]
        started = w.started_at or time.time()

        def record(db):
            store.upsert_rank(db, group.attempt_id, w.rank, pid=w.pid, create_time=w.create_time, host=self.host,
                              device=w.device, state="running", started_at=started,
                              log_path=str(w.log_path), role="tp-worker", tp_rank=w.tp_rank,
                              # The vllm backend runs one driver rank (the stage refuses more).
                              parent_rank=0)
            for rank in drivers:
                store.upsert_rank(db, group.attempt_id, rank, role="driver")
            self._emit_state(group.run_id, "rank", "running", f"TP rank {w.tp_rank} (pid {w.pid}) registered",
                             stage=group.stage, attempt=group.attempt)

        self.write_later(record, f"recording TP rank {w.tp_rank} of run {group.run_id} in eyas.db")

    def _record_exit(self, group: Group, ex: RankExit) -> None:
        """Queue a rank's exit; the settlement writes it again with the group's end."""
        fields = self._exit_fields(group, ex)
        self.write_later(lambda db: self._write_exit(db, group, ex, fields),
                         f"recording rank {ex.rank}'s exit in eyas.db")

    @staticmethod
    def _exit_fields(group: Group, ex: RankExit) -> dict:
        state = "failed" if group.counts_as_failure(ex) else ("exited" if not ex.failed else "killed")
        return {"state": state, "exit_code": ex.exit_code, "signal": ex.signal, "oom_killed": int(ex.oom_killed),
                "ended_at": ex.time, **({"pid": ex.pid} if ex.pid else {})}

    def _write_exit(self, db, group: Group, ex: RankExit, fields: dict) -> None:
        store.upsert_rank(db, group.attempt_id, ex.rank, **fields)
        self._emit_state(group.run_id, "rank", fields["state"], _exit_text(ex), stage=group.stage,
                         attempt=group.attempt)

    def _settle_group(self, group: Group) -> None:
        """Record the group's end (daemon/settle.py); it leaves memory only once that is written."""
        settle.settle(self, group, time.time())

    def _settled(self, group: Group) -> None:
        """The group's end is recorded: it leaves memory."""
        self.groups.pop(group.attempt_id, None)
        self.sampler.forget(group.attempt_id)
        self.stage_live.pop((group.run_id, group.stage), None)
        self.poke()

    def _backoff(self, db, run_id: int, stage: str) -> float:
        cfg = json.loads(db["runs"].get(run_id)["config_json"] or "{}")
        return _stage_value(cfg, stage, "backoff", 2.0)

    # -- metrics -------------------------------------------------------------------------

    def sample(self, now: float, groups: list[Group] | None = None, final: bool = False) -> None:
        """Sample the live ranks (or, with `final`, every rank of `groups` one last time, so
        that the progress lines written just before exiting are not lost)."""
        groups = list(self.groups.values()) if groups is None else groups
        refs = []
        for g in groups:
            # A TP worker is measured as its own rank, so its tree is kept out of its driver's.
            tp_pids = frozenset(w.pid for w in g.workers.values() if w.pid)
            refs += [RankRef(g.run_id, g.stage, g.attempt, g.attempt_id, r.rank, r.monitor_pid, r.monitor_create_time,
                             g.dir / contract.rank_file(r.rank, contract.PROGRESS), g.metrics_since, exclude=tp_pids)
                     for r in g.ranks if final or r.exit is None]
            refs += [RankRef(g.run_id, g.stage, g.attempt, g.attempt_id, w.rank, w.pid, w.create_time,
                             g.dir / contract.tp_file(k, contract.PROGRESS), g.metrics_since)
                     for k, w in sorted(g.workers.items()) if final or _running(w)]
        if not refs:
            return
        result = self.sampler.sample(refs, now)
        for (attempt_id, _rank), pids in result.descendants.items():
            group = self.groups.get(attempt_id)
            if group is not None:
                group.seen.update(pids)
        attempt_of = {(g.run_id, g.stage): g.attempt_id for g in groups}
        self.stage_live.update(result.stages)
        self._queue_metrics(result.metrics, result.ranks,
                            {attempt_of[key]: key for key in result.stages})
        by_group: dict[tuple, list] = {}
        for row in result.metrics:
            if row["run_id"] is not None:
                by_group.setdefault((row["run_id"], row["stage"], row["attempt"]), []).append(row)
        for (run_id, stage, attempt), rows in by_group.items():
            self.publish("metric", {"run_id": run_id, "stage": stage, "attempt": attempt, "samples": rows,
                                    "live": self.stage_live.get((run_id, stage))})

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
                if not taken:           # once: a try that met the lock keeps what it took
                    with self._metrics_lock:
                        taken.append(self._metrics_buf)
                        self._metrics_buf = None
                self._write_metrics(db, taken[0])

            self.write_later(write, "writing metrics to eyas.db")

    @staticmethod
    def _write_metrics(db, buf: dict) -> None:
        store.insert_metrics(db, buf["rows"])
        for (attempt_id, rank), fields in buf["ranks"].items():
            db.execute("UPDATE ranks SET " + ", ".join(f"{k} = ?" for k in fields) + " WHERE attempt_id = ? AND rank = ?",
                       [*fields.values(), attempt_id, rank])
        for attempt_id, (run_id, stage) in buf["stages"].items():
            # History keeps the steady figure: the sum of the ranks' mean rates over the
            # attempt, not the instantaneous rate that the live views show.
            tok_s, peak = db.execute("SELECT sum(tok_s), max(peak_gpu_mem) FROM ranks WHERE attempt_id = ?",
                                     [attempt_id]).fetchone()
            if tok_s is not None:
                db.execute("UPDATE stages SET tok_s = ? WHERE run_id = ? AND name = ?", [tok_s, run_id, stage])
                db.execute("UPDATE runs SET tok_s = ? WHERE id = ?", [tok_s, run_id])
            if peak is not None:
                db.execute("UPDATE stages SET peak_gpu_mem = max(coalesce(peak_gpu_mem, 0), ?) "
                           "WHERE run_id = ? AND name = ?", [peak, run_id, stage])
                db.execute("UPDATE runs SET peak_gpu_mem = max(coalesce(peak_gpu_mem, 0), ?) WHERE id = ?",
                           [peak, run_id])

    # -- start-up and the loop -------------------------------------------------------------

    @staticmethod
    def _running_attempts(db) -> list[tuple[dict, dict, float | None, dict, dict]]:
        """Each running attempt with its ranks' rows, its last stored metric time, its run's
        config and its run's row."""
        found = []
        for a in db["attempts"].rows_where("state = 'running'"):
            rows = {r["rank"]: r for r in db["ranks"].rows_where("attempt_id = ?", [a["id"]])}
            since = db.execute("SELECT max(time) FROM metrics WHERE run_id = ? AND stage = ? AND attempt = ?",
                               [a["run_id"], a["stage"], a["number"]]).fetchone()[0]
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
            group = Group(a["run_id"], a["stage"], a["id"], a["number"], attempt_dir, a["world_size"],
                          json.loads(a["devices"] or "[]"), a["master_port"] or 0,
                          started_at=a["started_at"] or time.time())
            unstarted, found_later = [], []
            for r in range(a["world_size"]):
                row = rows.get(r) or {}
                proc = _read_json(attempt_dir / contract.rank_file(r, contract.PROC)) or {}
                if not row and not proc and not (attempt_dir / contract.rank_file(r, contract.LOG)).exists():
                    unstarted.append(r)     # the log is made just before the process: never begun
                mpid = row.get("monitor_pid") or proc.get("monitor_pid")
                mct = row.get("monitor_create_time") or proc.get("monitor_create_time")
                if not mpid and (found := intent.find_monitor(group, r)) is not None:
                    mpid, mct = found
                if mpid and not row.get("monitor_pid"):
                    found_later.append((r, mpid, mct))      # its row was never written: now it is
                rank = Rank(r, attempt_dir / contract.rank_file(r, contract.LOG), mpid or 0, mct, None,
                            row.get("pid") or proc.get("pid"), row.get("create_time") or proc.get("create_time"),
                            row.get("device"))
                if row.get("state") in ("exited", "failed", "killed"):
                    rank.exit = RankExit(r, rank.pid, row.get("exit_code"), row.get("signal"),
                                         row.get("ended_at") or time.time(), group.rank_error(rank))
                rank.role = row.get("role")
                group.ranks.append(rank)
            self._recover_workers(group, rows.values())
            # Progress lines already stored by the previous daemon feed the rates but are
            # not inserted twice.
            group.metrics_since = since
            _set_bounds(group, cfg)
            if found_later:
                self.write_later(lambda db, a=a["id"], found=found_later: [
                    store.upsert_rank(db, a, r, monitor_pid=mpid, monitor_create_time=mct, host=self.host)
                    for r, mpid, mct in found], f"recording the re-adopted ranks of run {a['run_id']}")
            if unstarted and a.get("cancel_reason") is None and not a.get("stuck_json"):
                self._finish_spawn(group, unstarted, run, cfg)
            self.groups[a["id"]] = group
            intent.resume(self, group, a)
            log.info("re-adopted run %s %s attempt %s (%s ranks)", a["run_id"], a["stage"], a["number"], a["world_size"])

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
        env = {contract.LOG_MAX_MB: f"{_log_max_mb(cfg, group.stage):g}"}
        try:
            for r in unstarted:
                group.ranks[r] = group._start_rank(r, output_dir, run_dir / "config.json", env)
        except OSError:
            log.exception("run %s: %s attempt %d: could not finish starting its ranks", group.run_id,
                          group.stage, group.attempt)
            return
        log.warning("run %s: %s attempt %d: the last daemon died while starting its ranks; started rank%s %s "
                    "now (port %d)", group.run_id, group.stage, group.attempt, "" if len(unstarted) == 1 else "s",
                    ", ".join(map(str, unstarted)), port)
        now = time.time()
        ranks = [(group.ranks[r].rank, group.ranks[r].monitor_pid, group.ranks[r].monitor_create_time,
                  group.ranks[r].device, str(group.ranks[r].log_path)) for r in unstarted]

        def record(db):
            db["attempts"].update(group.attempt_id, {"master_port": port})
            for rank, mpid, mct, device, log_path in ranks:
                store.upsert_rank(db, group.attempt_id, rank, monitor_pid=mpid, monitor_create_time=mct,
                                  host=self.host, device=device, state="running", started_at=now, log_path=log_path)

        self.write_later(record, f"recording the ranks started for run {group.run_id} {group.stage}")

    async def check_run_folders(self) -> None:
        """Warn, once at start, about run folders that no run of the database records: the
        database was deleted or an older backup restored since they were written. They are
        another history's logs and outputs: left alone, and new runs get ids above them."""
        rows = await self.write(lambda db: list(db.query("SELECT id, dir FROM runs")), "reading the run folders")
        known = {paths.run_dir(row, self.home).resolve() for row in rows}
        unknown = sorted(i for i, path in paths.folder_ids(self.home).items() if path.resolve() not in known)
        if unknown:
            log.warning("%s holds %d run folder%s that the database does not know (ids %s): written before "
                        "the database was deleted or restored from a backup; they are left alone, and new "
                        "runs get ids above them", paths.runs_dir(self.home), len(unknown),
                        "" if len(unknown) == 1 else "s", _id_ranges(unknown))

    @staticmethod
    def _recover_workers(group: Group, rows) -> None:
        """Re-adopt a vLLM driver's TP workers; their log split resumes from its state file."""
        for row in rows:
            if row.get("role") != "tp-worker" or row.get("tp_rank") is None:
                continue
            k = row["tp_rank"]
            parent = row.get("parent_rank") or 0
            driver = group.ranks[parent] if 0 <= parent < len(group.ranks) else None
            w = Rank(row["rank"], group.dir / contract.tp_file(k, contract.LOG), driver.monitor_pid if driver else 0,
                     driver.monitor_create_time if driver else None, None, row.get("pid"), row.get("create_time"),
                     row.get("device"), role="tp-worker", tp_rank=k, started_at=row.get("started_at"))
            if row.get("state") in ("exited", "failed", "killed"):
                w.exit = RankExit(row["rank"], w.pid, row.get("exit_code"), row.get("signal"),
                                  row.get("ended_at") or time.time(), group.tp_error(w),
                                  unexpected=row.get("state") == "failed", tp_rank=k)
            group.workers[k] = w
        if group.workers and group.ranks:
            driver = group.ranks[0]
            group.splitter = LogSplitter(driver.log_path, group.dir / contract.rank_file(driver.rank, contract.SPLIT))

    async def shutdown(self, grace: float | None = None) -> None:
        self.stopping = True
        grace = self.grace if grace is None else grace
        for g in list(self.groups.values()):
            if g.teardown_since is None and g.cancel_reason is None:
                self._record_stop(g, "the daemon was stopped")
            g.cancel_reason = g.cancel_reason or "the daemon was stopped"
        await asyncio.gather(*(g.teardown(grace, "the daemon was stopped") for g in list(self.groups.values())))
        # Settle what ended; a store held locked by another process gets SHUTDOWN_WAIT_S,
        # then the groups are left to the next daemon, which settles them from their files.
        until = time.time() + SHUTDOWN_WAIT_S
        while True:
            self.supervise()
            if not self.groups or time.time() > until:
                break
            await asyncio.sleep(0.05)
        if self.groups:
            log.warning("stopping with %d group%s not recorded as ended (%s); the next daemon settles them",
                        len(self.groups), "" if len(self.groups) == 1 else "s",
                        self.store.status() or "the store did not answer")
        self._shutdown_done.set()

    def prune(self) -> None:
        now = time.time()
        self.write_later(lambda db: store.prune_metrics(db, max_age_s=METRICS_MAX_AGE, max_rows=METRICS_MAX_ROWS,
                                                        now=now), "pruning metrics")

    def _step(self, what: str, fn, *args, **kwargs) -> None:
        """One step of the supervision loop. The daemon survives its own bugs (logged) and a
        full state directory (noted on the condition, retried with backoff); it keeps supervising."""
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            if diskfull.is_full(exc):
                self.disk.mark(what, exc)
            else:
                log.exception("%s pass failed", what)

    async def run(self) -> None:
        """The supervision loop: 20 Hz rank checks, scheduling on change, 1 Hz sampling."""
        self._shutdown_done = asyncio.Event()
        await self.recover()
        try:
            await self.check_run_folders()
        except OSError:
            log.exception("could not look through %s for run folders", paths.runs_dir(self.home))
        while not self._shutdown_done.is_set():
            now = time.time()
            # Each step on its own: one that fails (a bug, a full disk) must not stop the
            # others, the hang watchdog least of all.
            self._step("supervision", self.supervise)
            if self._dirty.is_set() or now - self._last_sample >= SAMPLE_PERIOD:
                self._dirty.clear()
                self._step("scheduling", self.schedule)
            if now - self._last_sample >= SAMPLE_PERIOD:
                self._last_sample = now
                self._step("checking free space", self.disk.check, now)
                if not self.disk.full:      # metrics wait for space; the record comes first
                    self._step("writing metrics to eyas.db", self.sample, now)
                self._step("hang watch", self.watch_hangs, now)
            if now - self._last_prune >= PRUNE_PERIOD and not self.disk.full:
                self._last_prune = now
                self._step("pruning metrics", self.prune)
            try:
                await asyncio.wait_for(self._dirty.wait(), timeout=0.05)
            except TimeoutError:
                pass


def _stage_value(cfg: dict, stage: str, key: str, default: float) -> float:
    """A [stages.<stage>] setting from a run's config JSON; `default` where the table or key is absent."""
    value = ((cfg.get("stages") or {}).get(stage) or {}).get(key)
    return float(default if value is None else value)


def _log_max_mb(cfg: dict, stage: str) -> float:
    """stages.<stage>.log_max_mb of a run; the declared default for a config written without it."""
    return _stage_value(cfg, stage, "log_max_mb", run_config.LOG_MAX_MB)


def _set_bounds(group: Group, cfg: dict) -> None:
    """The hang watchdog's bounds of the group's stage: the run's, else the stage spec's."""
    spec = specs.STAGES[group.stage]
    group.stall_timeout = _stage_value(cfg, group.stage, "stall_timeout", spec.stall_timeout)
    group.exit_timeout = _stage_value(cfg, group.stage, "exit_timeout", spec.exit_timeout)


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


def _running(rank: Rank) -> bool:
    """Still worth sampling: not ended, or ended only by its own error record (it may live on)."""
    return rank.exit is None or (rank.exit.error is not None and rank.exit.signal is None)


def _exit_text(ex: RankExit) -> str:
    who = _who(ex)
    if ex.lost:
        return f"{who} lost"
    if ex.signal is not None:
        return f"{who} killed by {ex.signal_name}" + (" (OOM)" if ex.oom_killed else "")
    if ex.error is not None:
        return f"{who} raised {ex.error.get('type')}"
    if ex.tp_rank is not None and not ex.unexpected:
        return f"{who} ended with its engine"
    return f"{who} exited with code {ex.exit_code}"
