"""The daemon's socket API: one `op_<name>` method per request, each a few store jobs and signals; errors become the protocol's error codes.

A request waits for the store at most OP_TIMEOUT (another process may hold eyas.db locked):
then it is refused as `store_busy` with nothing done, and it can never run later. A stop of
live ranks is the exception: it never waits for the store (op_stop, daemon/intent.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from sqlite_utils.db import NotFoundError

from eyas.state import machine, paths, specs, store
from eyas.state import runconfig as run_config
from eyas.wire import protocol
from eyas.wire.protocol import ProtocolError

from . import diskfull
from . import native as native_stacks
from .group import Group
from .storewriter import StoreBusy

log = logging.getLogger("eyas.daemon.api")

# How long a request waits for the store when another process holds the database locked,
# before its answer is "store busy" (and nothing of it was done); clients wait longer.
OP_TIMEOUT = 5.0
# How long a stop's answer waits for the store to record it, once the ranks are signalled: the
# answer says whether it is recorded yet, and a held lock never delays it longer than this.
RECORD_WAIT = 0.5
STOPPED = "stopped by the user"


class Api:
    """The request handlers of the daemon's Core (daemon/core.py)."""

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
            raise ProtocolError(
                protocol.STATE_FULL,
                f"state directory full: {self.disk.state.what}; "
                f"{req.op} was not done (free space in {self.home} and try again)",
            ) from None
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
            active.append(
                {
                    "run_id": g.run_id,
                    "stage": g.stage,
                    "attempt": g.attempt,
                    "world_size": g.world_size,
                    "devices": g.devices,
                    "pids": [r.pid or r.monitor_pid for r in g.ranks],
                    "tok_s": live.get("tok_s"),
                    "eta_s": live.get("eta_s"),
                    "progress": live.get("progress"),
                }
            )
        return {
            "pid": os.getpid(),
            "uptime": time.time() - self.started,
            "home": str(self.home),
            # The socket the server serves (daemon.main sets it; it moves when rebound).
            "socket": str(self.served_socket or paths.socket_path(self.home, create=False)),
            "database": str(paths.db_path(self.home)),
            # `waiting` copied at once (one C call): the store thread edits it.
            "active": active,
            "waiting": {str(k): v for k, v in dict(self.waiting).items()},
            "gpu": self.sampler.gpu_available,
            "full": self.disk.status(),
            "store_busy": self.store.status(),
        }

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
            stages.append(
                {"name": name, "max_restarts": max_restarts, "world_size": run_config.stage_world_size(cfg, name)}
            )
        model = Path(cfg.target.path).name if getattr(cfg.target, "path", None) else None
        claimed: list[Path] = []

        def create(db):
            # The folder first, then the row that records it: the id is one no folder on disk
            # has (paths.claim_run_dir), whatever the database remembers.
            last = db.execute("SELECT max(id) FROM runs").fetchone()[0] or 0
            # A Slurm run's folder lies where its nodes see it ([slurm] state_dir), if not in
            # the daemon's own state directory; its id stays the database's.
            shared = cfg.slurm.state_dir if cfg.resources.executor == "slurm" else None
            run_id, run_dir = paths.claim_run_dir(last + 1, Path(shared) if shared else self.home)
            claimed.append(run_dir)
            output_dir = Path(cfg.output_dir) if cfg.output_dir else run_dir / "out"
            data["output_dir"] = str(output_dir)
            (run_dir / "config.json").write_text(json.dumps(data, indent=2))
            store.create_run(
                db,
                name=cfg.name,
                model=model,
                stages=stages,
                config=data,
                config_path=str(Path(config_path).absolute()),
                output_dir=str(output_dir),
                run_id=run_id,
                dir=str(run_dir),
            )
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
        for run_dir in claimed[:-1]:  # claimed by a try that met the lock
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
        return next(
            (g for g in self.groups.values() if g.run_id == run_id and (stage is None or g.stage == stage)), None
        )

    @contextlib.asynccontextmanager
    async def _deciding(self, what: str):
        """Hold off the scheduler: what is in memory (the live groups) and in the store agree
        while a stop looks at both."""
        try:
            await asyncio.wait_for(self._decide.acquire(), OP_TIMEOUT)
        except TimeoutError:
            if self.submitting is not None and self.store.busy is None:
                raise StoreBusy(
                    f"{what} was not done: the daemon is waiting on Slurm's controller for the "
                    f"{self.submitting} (try again once it answers: sinfo shows whether it is up)"
                ) from None
            raise StoreBusy(self.store.busy_text(what)) from None
        try:
            yield
        finally:
            self._decide.release()

    async def op_stop(self, run: int, stage: str | None = None) -> dict:
        """Stop a run, or one stage of it. Live ranks are signalled at once from memory,
        whatever holds the store or the scheduler (the stop is durable before the signal:
        intent.py), and the answer says whether the store has it yet. With nothing live there
        is nothing to signal: the stop is a change of the record, refused under a held lock
        with nothing done, as any request is."""
        run_id = self._run_id(run)
        if self._live_of(run_id, stage):
            return await self._stop_live(run_id, stage)
        deadline = time.monotonic() + OP_TIMEOUT
        what = f"run {run_id} has no live ranks to signal, so the stop is only a change to its record, and that"
        try:
            async with self._deciding(what):
                if self._live_of(run_id, stage):  # started by the scheduler's pass just waited for
                    return await self._stop_live(run_id, stage)

                def stop(db):
                    row = self._run_row(db, run_id)
                    if stage is None:
                        machine.check("run", row["state"], "cancelled", f"run {run_id}")
                    target = stage or self._stage_or_default(db, run_id, None, ("running", "pending"))
                    srow = store.stage_row(db, run_id, target)
                    # The stage and its run together (a pending restart goes with the move).
                    self._move_stage(run_id, target, "cancelled", STOPPED)
                    if srow["state"] == "running" or stage is None:
                        self._finish_run(db, run_id, "cancelled", f"stage {target} stopped by the user")
                    return target

                # One wait for the whole request: the scheduler's hold and the store's together.
                target = await self.write(stop, what, timeout=max(0.1, deadline - time.monotonic()))
        except StoreBusy as exc:
            if self.store.busy is None:  # the scheduler waits on Slurm's controller: its own words
                raise
            raise StoreBusy(
                self.store.busy_text(what, f"run `eyas stop {run_id}` again once the lock is released")
            ) from exc
        return {"run_id": run_id, "stage": target, "stopping": False, "recorded": True}

    def _live_of(self, run_id: int, stage: str | None) -> list[Group]:
        """The live groups a stop ends: the run's, or the stage's, with its streaming sibling
        (a pair stops as one: neither half can go on without the other)."""
        group = self._group_of(run_id, stage)
        if group is None:
            return []
        other = specs.sibling(group.stage)
        return [group, *(g for g in self.groups.values() if g.run_id == run_id and g.stage == other)]

    async def _stop_live(self, run_id: int, stage: str | None) -> dict:
        """Signal the live groups now; wait RECORD_WAIT at most for the store to record it."""
        groups = self._live_of(run_id, stage)
        if self._decide.locked():
            # The scheduler is mid-pass: a group of this run it starts meanwhile (the second
            # half of a streaming pair) is stopped too, once the pass is over.
            stages = None if stage is None else {g.stage for g in groups}
            self._spawn_task(self._stop_late_starts(run_id, stages))
        records = [f for f in await asyncio.gather(*(self._cancel_group(g, STOPPED) for g in groups)) if f]
        if records:
            await asyncio.wait(records, timeout=RECORD_WAIT)
        recorded = (
            all(f.done() and not f.cancelled() and f.exception() is None for f in records)
            if records
            else self.store.busy is None  # stopping already: recorded when the store is free
        )
        log.info(
            "run %s: stop of %s signalled%s",
            run_id,
            ", ".join(g.stage for g in groups),
            "" if recorded else f"; recorded once the store is free ({self.store.status()})",
        )
        reply = {"run_id": run_id, "stage": groups[0].stage, "stopping": True, "recorded": recorded}
        if not recorded:  # why not yet: a lock another process holds, a full state directory
            reply.update(store_busy=self.store.status(), full=self.disk.status())
        return reply

    async def _stop_late_starts(self, run_id: int, stages: set[str] | None) -> None:
        async with self._decide:
            for g in [g for g in self.groups.values() if g.run_id == run_id and (stages is None or g.stage in stages)]:
                await self._cancel_group(g, STOPPED)  # nothing for a group stopping already

    async def op_retry(self, run: int, stage: str | None = None) -> dict:
        run_id = self._run_id(run)

        def retry(db):
            row = self._run_row(db, run_id)
            if row["state"] not in ("pending", "running"):
                machine.check("run", row["state"], "pending", f"run {run_id}")
            name = self._stage_or_default(db, run_id, stage, ("failed", "cancelled"))
            # Both or neither: a pending stage of a failed run never starts.
            self._move_stage(run_id, name, "pending", "retry requested", restarts=0)
            other = specs.sibling(name)
            if other is not None and specs.streaming(json.loads(row["config_json"] or "{}")):
                # A streaming pair starts together (daemon/scheduler.py): the other half comes along.
                if store.stage_row(db, run_id, other)["state"] in ("failed", "cancelled"):
                    self._move_stage(run_id, other, "pending", f"retry of {name} requested", restarts=0)
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
                    f"stage {stage} of run {run_id} is running; stop it first (eyas stop {run_id} --stage {stage})"
                )
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
            raise machine.IllegalTransition(
                f"{what}: only live ranks have stacks (a failed rank's traceback: eyas errors {run_id})"
            )
        members = [*group.ranks, *group.workers.values()]
        ranks = (
            await group.collect_stacks(members, descendants=True, native_timeout=native_stacks.INTERACTIVE_TIMEOUT)
            if native
            else await group.request_stacks(members, descendants=True)
        )
        log.info(
            "run %s: %s attempt %d: stacks requested from %d ranks",
            run_id,
            group.stage,
            group.attempt,
            sum("offset" in r for r in ranks),
        )
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
