"""The daemon's core: runs and stages, device queues, controls, and supervision of the
live rank groups. It answers the socket API (as the server's handler) and keeps SQLite
up to date; it is the only writer of the store."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from sqlite_utils.db import NotFoundError

from eyas.state import machine, paths, store
from eyas.workers import config as run_config
from eyas.workers import specs

from . import diskfull, intent, native, protocol, settle, stacks, watchdog
from .logsplit import LogSplitter
from .protocol import ProtocolError
from .sampler import RankRef, Sampler
from .settle import who as _who
from .supervisor import Group, Rank, RankExit, _read_json

log = logging.getLogger("eyas.daemon.core")

SAMPLE_PERIOD = 1.0
# Retention (README): raw samples older than a week go, and never more than 2M rows;
# the history listings read roll-ups, which are kept forever.
METRICS_MAX_AGE = 7 * 24 * 3600.0
METRICS_MAX_ROWS = 2_000_000
PRUNE_PERIOD = 600.0


class Core:
    def __init__(self, db, home: Path, *, grace: float = 10.0, sampler: Sampler | None = None,
                 publish=None, wants=None):
        self.db = db
        self.home = home
        self.grace = grace
        self.sampler = sampler or Sampler()
        self.publish = publish or (lambda topic, data: None)
        self.wants = wants or (lambda topic: False)
        self.host = socket.gethostname()
        self.groups: dict[int, Group] = {}           # attempt id -> live group
        # A full state directory (daemon/diskfull.py): no attempt starts while it lasts.
        self.disk = diskfull.Condition(home)
        self.disk.on_change = self._disk_changed
        self._held: list[dict] | None = None       # state events of the open transaction
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
        if self._held is not None:
            self._held.append(event)
        else:
            self.publish("state", event)

    @contextlib.contextmanager
    def transaction(self):
        """One store transaction, nested ones joining it; its state events go out to the
        subscribers only once it has committed, so that none announces a rolled-back change."""
        if self._held is not None:
            with self.db.atomic():
                yield
            return
        self._held = []
        try:
            with self.db.atomic():
                yield
            events = self._held
        finally:
            self._held = None
        for event in events:
            self.publish("state", event)

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
                "socket": str(getattr(self, "served_socket", None) or paths.socket_path(self.home, create=False)),
                "database": str(paths.db_path(self.home)),
                "active": active, "waiting": {str(k): v for k, v in self.waiting.items()},
                "gpu": self.sampler.gpu_available, "full": self.disk.status()}

    def _run(self, run: Any) -> dict:
        if isinstance(run, bool) or not isinstance(run, (int, str)) or not str(run).strip().isdigit():
            raise ProtocolError(protocol.BAD_REQUEST, f"run: {run!r} is not a run id (a whole number)")
        try:
            return self.db["runs"].get(int(run))
        except NotFoundError:
            raise store.NotFound(f"no run {run}") from None

    def op_submit(self, config_path: str) -> dict:
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
        # The folder first, then the row that records it: the id is one no folder on disk
        # has (paths.claim_run_dir), whatever the database remembers.
        last = self.db.execute("SELECT max(id) FROM runs").fetchone()[0] or 0
        run_id, run_dir = paths.claim_run_dir(last + 1, self.home)
        output_dir = Path(cfg.output_dir) if cfg.output_dir else run_dir / "out"
        data["output_dir"] = str(output_dir)
        (run_dir / "config.json").write_text(json.dumps(data, indent=2))
        store.create_run(self.db, name=cfg.name, model=model, stages=stages, config=data,
                         config_path=str(Path(config_path).absolute()), output_dir=str(output_dir),
                         run_id=run_id, dir=str(run_dir))
        self._emit_state(run_id, "run", "pending", "submitted")
        log.info("run %s submitted: %s (%s)", run_id, cfg.name, ", ".join(cfg.pipeline))
        return {"run_id": run_id, "stages": list(cfg.pipeline), "output_dir": str(output_dir)}

    def _stage_or_default(self, run_id: int, stage: str | None, states: tuple[str, ...]) -> str:
        if stage:
            store.stage_row(self.db, run_id, stage)
            return stage
        for row in self.db["stages"].rows_where("run_id = ?", [run_id], order_by="position"):
            if row["state"] in states:
                return row["name"]
        raise machine.IllegalTransition(f"run {run_id} has no stage that is {' or '.join(states)}")

    def _group_of(self, run_id: int, stage: str | None = None) -> Group | None:
        return next((g for g in self.groups.values()
                     if g.run_id == run_id and (stage is None or g.stage == stage)), None)

    def op_stop(self, run: int, stage: str | None = None) -> dict:
        row = self._run(run)
        run_id = row["id"]
        if stage is None:
            machine.check("run", row["state"], "cancelled", f"run {run_id}")
        group = self._group_of(run_id, stage)
        target = stage or (group.stage if group else None)
        if group is not None:
            intent.stop(self, group, "stopped by the user")
            return {"run_id": run_id, "stage": group.stage, "stopping": True}
        if target is None:
            target = self._stage_or_default(run_id, None, ("running", "pending"))
        srow = store.stage_row(self.db, run_id, target)
        with self.transaction():    # the stage and its run together (a pending restart goes with the move)
            self._move_stage(run_id, target, "cancelled", "stopped by the user")
            if srow["state"] == "running" or stage is None:
                self._finish_run(run_id, "cancelled", f"stage {target} stopped by the user")
        return {"run_id": run_id, "stage": target, "stopping": False}

    def op_retry(self, run: int, stage: str | None = None) -> dict:
        row = self._run(run)
        run_id = row["id"]
        if row["state"] not in ("pending", "running"):
            machine.check("run", row["state"], "pending", f"run {run_id}")
        stage = self._stage_or_default(run_id, stage, ("failed", "cancelled"))
        with self.transaction():    # both or neither: a pending stage of a failed run never starts
            self._move_stage(run_id, stage, "pending", "retry requested", restarts=0)
            if row["state"] in ("failed", "cancelled"):
                self._move_run(run_id, "pending", f"retry of {stage} requested")
        return {"run_id": run_id, "stage": stage}

    def op_skip(self, run: int, stage: str) -> dict:
        row = self._run(run)
        run_id = row["id"]
        srow = store.stage_row(self.db, run_id, stage)
        if srow["state"] == "running":
            raise machine.IllegalTransition(
                f"stage {stage} of run {run_id} is running; stop it first (eyas stop {run_id} --stage {stage})")
        self._move_stage(run_id, stage, "skipped", "skipped by the user")
        return {"run_id": run_id, "stage": stage}

    async def op_stacks(self, run: int, stage: str | None = None) -> dict:
        """Ask the live ranks of the run's running stage to write their Python stacks to their
        logs, and return every live process's native stacks (py-spy) in the reply."""
        run_id = self._run(run)["id"]
        group = self._group_of(run_id, stage)
        if group is None:
            what = f"stage {stage} of run {run_id} is not running" if stage else f"run {run_id} has no running stage"
            raise machine.IllegalTransition(f"{what}: only live ranks have stacks "
                                            f"(a failed rank's traceback: eyas errors {run_id})")
        ranks = await stacks.collect([*group.ranks, *group.workers.values()],
                                     native_timeout=native.INTERACTIVE_TIMEOUT)
        log.info("run %s: %s attempt %d: stacks requested from %d ranks", run_id, group.stage, group.attempt,
                 sum("offset" in r for r in ranks))
        return {"run_id": run_id, "stage": group.stage, "attempt": group.attempt, "ranks": ranks}

    def op_resume(self, run: int) -> dict:
        row = self._run(run)
        run_id = row["id"]
        machine.check("run", row["state"], "pending", f"run {run_id}")
        again = []
        with self.transaction():
            for s in self.db["stages"].rows_where("run_id = ? and state in ('failed','cancelled')", [run_id]):
                self._move_stage(run_id, s["name"], "pending", "run resumed", restarts=0)
                again.append(s["name"])
            self._move_run(run_id, "pending", "resumed by the user")
        return {"run_id": run_id, "stages": again}

    async def op_shutdown(self, grace: float | None = None) -> dict:
        asyncio.get_running_loop().call_soon(lambda: self._spawn_task(self.shutdown(grace)))
        return {"stopping": True, "active": len(self.groups)}

    # -- scheduling ----------------------------------------------------------------------

    def _held_devices(self) -> dict[int, int]:
        return {d: g.run_id for g in self.groups.values() for d in g.devices}

    def _devices_for(self, cfg: dict, stage: str, world_size: int) -> list[int] | None:
        """The GPUs a stage needs, or None when they are busy. [] means CPU only."""
        wanted = cfg.get("resources", {}).get("devices", "auto")
        held = self._held_devices()
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

    def _finish_run(self, run_id: int, state: str, reason: str) -> None:
        row = self.db["runs"].get(run_id)
        if row["state"] == state:
            return
        if row["state"] == "pending" and state in ("succeeded",):
            self._move_run(run_id, "running", "started")
        self._move_run(run_id, state, reason)
        self.waiting.pop(run_id, None)

    def schedule(self) -> None:
        """Start what can start: the next stage of each run, queued behind device holders.
        Nothing starts while the state directory is full, and a running stage without a live
        group starts again only when the store holds its restart's due time (intent.py)."""
        if self.stopping or self.disk.full:
            return
        now = time.time()
        for run in self.db["runs"].rows_where("state in ('pending','running')", order_by="created_at, id"):
            run_id = run["id"]
            if self._group_of(run_id) is not None:
                continue
            cfg = json.loads(run["config_json"] or "{}")
            for s in self.db["stages"].rows_where("run_id = ?", [run_id], order_by="position"):
                if s["state"] in ("succeeded", "skipped"):
                    continue
                if s["state"] in ("failed", "cancelled"):
                    self._finish_run(run_id, s["state"], f"stage {s['name']} {s['state']}")
                    break
                due = s["restart_at"]
                if s["state"] == "running" and due is None:
                    # No policy called for another attempt: the record of the last one is
                    # not written yet, or a restart was refused; never start one unasked.
                    break
                if due is not None and due > now:
                    break
                self._start_stage(run, cfg, s)
                break
            else:
                self._finish_run(run_id, "succeeded", "every stage succeeded or was skipped")

    def _start_stage(self, run: dict, cfg: dict, s: dict) -> None:
        run_id, stage = run["id"], s["name"]
        world_size = s["world_size"] or 1
        devices = self._devices_for(cfg, stage, world_size)
        if devices is None:
            holders = sorted({str(r) for r in self._held_devices().values()})
            why = f"waiting for devices held by run {', '.join(holders)}"
            if self.waiting.get(run_id) != why:
                self.waiting[run_id] = why
                self.db["runs"].update(run_id, {"reason": why})
                self._emit_state(run_id, "run", run["state"], why)
            return
        self.waiting.pop(run_id, None)
        number = (s["attempts"] or 0) + 1
        # Everything under the run's recorded folder, never one rebuilt from its id; a new
        # attempt's folder is one that does not exist yet (Group.spawn creates it exclusively).
        run_dir = paths.run_dir(run, self.home)
        attempt_dir = paths.unused(run_dir / stage / f"attempt-{number}")
        output_dir = Path(run["output_dir"] or run_dir / "out")
        output_dir.mkdir(parents=True, exist_ok=True)
        port_hint = None
        # The run's, the stage's and the attempt's start in one transaction, before any spawn:
        # a restarted daemon finds the attempt (and re-adopts or settles it), or nothing at all.
        with self.transaction():
            if run["state"] == "pending":
                self._move_run(run_id, "running", f"starting {stage}")
            if s["state"] == "pending":
                self._move_stage(run_id, stage, "running", "started")
            attempt_id, number = store.new_attempt(self.db, run_id, stage, dir=str(attempt_dir),
                                                   world_size=world_size, devices=devices, master_port=port_hint)
        try:
            group = Group.spawn(run_id=run_id, stage=stage, attempt_id=attempt_id, attempt=number,
                                dir=attempt_dir, world_size=world_size, devices=devices,
                                output_dir=output_dir,
                                config_path=run_dir / "config.json")
        except OSError as exc:
            # The daemon could not even start the processes: that is the root cause.
            with self.transaction():
                store.record_error(self.db, attempt_id, rank=None, type=type(exc).__name__, message=str(exc),
                                   traceback="", time_=time.time(), root_cause=True, source="spawn")
                store.move_attempt(self.db, attempt_id, "failed", f"could not start ranks: {exc}")
                self._move_stage(run_id, stage, "failed", f"could not start ranks: {exc}")
            return
        # Supervised from here on, whether or not its rows can be written (a full disk): a
        # restarted daemon finds the ranks by their proc files or environment (intent.py).
        _set_bounds(group, cfg)
        self.groups[attempt_id] = group
        with self._noting_full(f"recording the ranks of run {run_id} {stage} attempt {number}"):
            with self.transaction():
                self.db["attempts"].update(attempt_id, {"master_port": group.master_port})
                for r in group.ranks:
                    store.upsert_rank(self.db, attempt_id, r.rank, monitor_pid=r.monitor_pid,
                                      monitor_create_time=r.monitor_create_time, host=self.host, device=r.device,
                                      state="running", started_at=time.time(), log_path=str(r.log_path))
        self._emit_state(run_id, "attempt", "running", f"attempt {number} started", stage=stage, attempt=number)
        log.info("run %s: %s attempt %s started with %s ranks (devices %s)", run_id, stage, number,
                 world_size, devices or "cpu")

    # -- supervision ---------------------------------------------------------------------

    def _spawn_task(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @contextlib.contextmanager
    def _noting_full(self, what: str):
        """Run a write that may be lost without harm (the settlement writes the same again):
        a full disk is noted on the condition and supervision goes on; other errors propagate."""
        try:
            yield
        except Exception as exc:
            if not diskfull.is_full(exc):
                raise
            self.disk.mark(what, exc)

    def _cancel_group(self, group: Group, reason: str) -> None:
        if group.teardown_since is None:
            group.cancel_reason = reason
            self._spawn_task(group.teardown(self.grace, reason))

    def supervise(self) -> None:
        """Check every group: record exits, tear down on the first failure, settle the end."""
        for attempt_id, group in list(self.groups.items()):
            learnt, exits = group.poll()
            for r in learnt:
                if r.role == "tp-worker":
                    group.watch(r)
                    self._record_worker(group, r)
                else:
                    with self._noting_full(f"recording rank {r.rank}'s pid in eyas.db"):
                        store.upsert_rank(self.db, attempt_id, r.rank, pid=r.pid, create_time=r.create_time)
            for ex in exits:
                # The teardown below must start even when the exit cannot be written yet.
                with self._noting_full(f"recording rank {ex.rank}'s exit in eyas.db"):
                    self._record_exit(group, ex)
            if group.teardown_since is None and any(group.counts_as_failure(e) for e in exits):
                first = group.failures()[0]
                self._spawn_task(group.teardown(self.grace, f"{_who(first)} failed"))
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
            self.record_stuck(group)         # durable before any signal (intent.py)
            self._spawn_task(watchdog.end(group, self.grace, self.record_stuck))

    def record_stuck(self, group: Group) -> None:
        """Write the watchdog's finding (and, once collected, the stacks) on its attempt."""
        with self._noting_full(f"recording run {group.run_id} {group.stage}'s {group.stuck['kind']} in eyas.db"):
            store.record_stuck(self.db, group.attempt_id, group.stuck)

    def _record_worker(self, group: Group, w: Rank) -> None:
        """A TP worker registered: a rank of the attempt from now on; its driver is one too."""
        store.upsert_rank(self.db, group.attempt_id, w.rank, pid=w.pid, create_time=w.create_time, host=self.host,
                          device=w.device, state="running", started_at=w.started_at or time.time(),
                          log_path=str(w.log_path), role="tp-worker", tp_rank=w.tp_rank,
                          # The vllm backend runs one driver rank (the stage refuses more).
                          parent_rank=0)
        for r in group.ranks:
            if r.role == "driver":
                store.upsert_rank(self.db, group.attempt_id, r.rank, role="driver")
        self._emit_state(group.run_id, "rank", "running", f"TP rank {w.tp_rank} (pid {w.pid}) registered",
                         stage=group.stage, attempt=group.attempt)

    def _record_exit(self, group: Group, ex: RankExit) -> None:
        state = "failed" if group.counts_as_failure(ex) else ("exited" if not ex.failed else "killed")
        store.upsert_rank(self.db, group.attempt_id, ex.rank, state=state, exit_code=ex.exit_code,
                          signal=ex.signal, oom_killed=int(ex.oom_killed), ended_at=ex.time,
                          **({"pid": ex.pid} if ex.pid else {}))
        self._emit_state(group.run_id, "rank", state, _exit_text(ex), stage=group.stage, attempt=group.attempt)

    def _settle_group(self, group: Group) -> None:
        """Record the group's end (daemon/settle.py); it leaves memory only once that is written."""
        if not settle.settle(self, group, time.time()):
            return
        del self.groups[group.attempt_id]
        self.sampler.forget(group.attempt_id)
        self.stage_live.pop((group.run_id, group.stage), None)
        self.poke()

    def _backoff(self, run_id: int, stage: str) -> float:
        cfg = json.loads(self.db["runs"].get(run_id)["config_json"] or "{}")
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
                             g.dir / f"rank-{r.rank}.progress.jsonl", g.metrics_since, exclude=tp_pids)
                     for r in g.ranks if final or r.exit is None]
            refs += [RankRef(g.run_id, g.stage, g.attempt, g.attempt_id, w.rank, w.pid, w.create_time,
                             g.dir / f"tp-{k}.progress.jsonl", g.metrics_since)
                     for k, w in sorted(g.workers.items()) if final or _running(w)]
        if not refs:
            return
        result = self.sampler.sample(refs, now)
        for (attempt_id, rank), pids in result.descendants.items():
            group = self.groups.get(attempt_id)
            if group is not None:
                group.seen.update(pids)
        store.insert_metrics(self.db, result.metrics)
        attempt_of = {(g.run_id, g.stage): g.attempt_id for g in groups}
        with self.db.atomic():
            for (attempt_id, rank), fields in result.ranks.items():
                self.db.execute(
                    "UPDATE ranks SET " + ", ".join(f"{k} = ?" for k in fields) + " WHERE attempt_id = ? AND rank = ?",
                    [*fields.values(), attempt_id, rank])
            for (run_id, stage), fields in result.stages.items():
                self.stage_live[(run_id, stage)] = fields
                # History keeps the steady figure: the sum of the ranks' mean rates over the
                # attempt, not the instantaneous rate that the live views show.
                tok_s, peak = self.db.execute(
                    "SELECT sum(tok_s), max(peak_gpu_mem) FROM ranks WHERE attempt_id = ?",
                    [attempt_of[(run_id, stage)]]).fetchone()
                if tok_s is not None:
                    self.db.execute("UPDATE stages SET tok_s = ? WHERE run_id = ? AND name = ?", [tok_s, run_id, stage])
                    self.db.execute("UPDATE runs SET tok_s = ? WHERE id = ?", [tok_s, run_id])
                if peak is not None:
                    self.db.execute("UPDATE stages SET peak_gpu_mem = max(coalesce(peak_gpu_mem, 0), ?) "
                                    "WHERE run_id = ? AND name = ?", [peak, run_id, stage])
                    self.db.execute("UPDATE runs SET peak_gpu_mem = max(coalesce(peak_gpu_mem, 0), ?) WHERE id = ?",
                                    [peak, run_id])
        by_group: dict[tuple, list] = {}
        for row in result.metrics:
            if row["run_id"] is not None:
                by_group.setdefault((row["run_id"], row["stage"], row["attempt"]), []).append(row)
        for (run_id, stage, attempt), rows in by_group.items():
            self.publish("metric", {"run_id": run_id, "stage": stage, "attempt": attempt, "samples": rows,
                                    "live": self.stage_live.get((run_id, stage))})

    # -- start-up and the loop -------------------------------------------------------------

    def recover(self) -> None:
        """Re-adopt the ranks of attempts that were running when the last daemon died.

        A rank is adopted only if its monitor's pid *and* start time match, so a recycled
        pid is never mistaken for it; ranks that ended meanwhile are settled from their
        exit records and error files on the first supervision pass.
        """
        for a in self.db["attempts"].rows_where("state = 'running'"):
            attempt_dir = Path(a["dir"])
            group = Group(a["run_id"], a["stage"], a["id"], a["number"], attempt_dir, a["world_size"],
                          json.loads(a["devices"] or "[]"), a["master_port"] or 0,
                          started_at=a["started_at"] or time.time())
            rows = {r["rank"]: r for r in self.db["ranks"].rows_where("attempt_id = ?", [a["id"]])}
            for r in range(a["world_size"]):
                row = rows.get(r) or {}
                proc = _read_json(attempt_dir / f"rank-{r}.proc.json") or {}
                mpid = row.get("monitor_pid") or proc.get("monitor_pid")
                mct = row.get("monitor_create_time") or proc.get("monitor_create_time")
                if not mpid and (found := intent.find_monitor(group, r)) is not None:
                    mpid, mct = found
                rank = Rank(r, attempt_dir / f"rank-{r}.log", mpid or 0, mct, None,
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
            group.metrics_since = self.db.execute(
                "SELECT max(time) FROM metrics WHERE run_id = ? AND stage = ? AND attempt = ?",
                [a["run_id"], a["stage"], a["number"]]).fetchone()[0]
            cfg = json.loads(self.db["runs"].get(a["run_id"])["config_json"] or "{}")
            _set_bounds(group, cfg)
            self.groups[a["id"]] = group
            intent.resume(self, group, a)
            log.info("re-adopted run %s %s attempt %s (%s ranks)", a["run_id"], a["stage"], a["number"], a["world_size"])

    def check_run_folders(self) -> None:
        """Warn, once at start, about run folders that no run of the database records: the
        database was deleted or an older backup restored since they were written. They are
        another history's logs and outputs: left alone, and new runs get ids above them."""
        known = {paths.run_dir(row, self.home).resolve() for row in self.db.query("SELECT id, dir FROM runs")}
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
            w = Rank(row["rank"], group.dir / f"tp-{k}.log", driver.monitor_pid if driver else 0,
                     driver.monitor_create_time if driver else None, None, row.get("pid"), row.get("create_time"),
                     row.get("device"), role="tp-worker", tp_rank=k, started_at=row.get("started_at"))
            if row.get("state") in ("exited", "failed", "killed"):
                w.exit = RankExit(row["rank"], w.pid, row.get("exit_code"), row.get("signal"),
                                  row.get("ended_at") or time.time(), group.tp_error(w),
                                  unexpected=row.get("state") == "failed", tp_rank=k)
            group.workers[k] = w
        if group.workers and group.ranks:
            driver = group.ranks[0]
            group.splitter = LogSplitter(driver.log_path, group.dir / f"rank-{driver.rank}.split.json")

    async def shutdown(self, grace: float | None = None) -> None:
        self.stopping = True
        grace = self.grace if grace is None else grace
        for g in list(self.groups.values()):
            if g.teardown_since is None:
                # Durable first (intent.py): killed during the teardown, the daemon still
                # settles these attempts as cancelled when it starts again.
                with self._noting_full(f"recording the stop of run {g.run_id} {g.stage}"):
                    store.record_cancel(self.db, g.attempt_id, "the daemon was stopped")
            g.cancel_reason = g.cancel_reason or "the daemon was stopped"
        await asyncio.gather(*(g.teardown(grace, "the daemon was stopped") for g in list(self.groups.values())))
        self.supervise()
        self._shutdown_done.set()

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
        self.recover()
        try:
            self.check_run_folders()
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
                self._step("pruning metrics", store.prune_metrics, self.db, max_age_s=METRICS_MAX_AGE,
                           max_rows=METRICS_MAX_ROWS)
            try:
                await asyncio.wait_for(self._dirty.wait(), timeout=0.05)
            except asyncio.TimeoutError:
                pass


def _stage_value(cfg: dict, stage: str, key: str, default: float) -> float:
    """A [stages.<stage>] setting from a run's config JSON; `default` where the table or key is absent."""
    value = ((cfg.get("stages") or {}).get(stage) or {}).get(key)
    return float(default if value is None else value)


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
