"""The agent: supervise the live groups (record exits, tear a group down on its first failure or on a stop, end stuck ones), and settle each group's end once it is over.

Nothing here waits for the store: the writes are queued (daemon/recording.py), the teardown
starts at once. How a group's end is recorded and whether it restarts is daemon/settle.py;
which failure is the root cause is daemon/failures.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from eyas.state import specs, store

from . import intent, settle, watchdog
from .failures import exit_text, who
from .group import Group
from .limits import stage_value
from .ranks import Rank, RankExit

log = logging.getLogger("eyas.daemon.agent")

# How long a stop whose intent file could not be written (a full disk) waits for its store
# record before signalling anyway (the settlement, written once the store lets it, carries the
# reason from memory). With the file written, nothing waits (intent.py).
INTENT_WAIT = 1.0
SHUTDOWN_WAIT_S = 30.0


class Agent:
    """The supervising half of the daemon's Core (daemon/core.py)."""

    def _spawn_task(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _record_stop(self, group: Group, reason: str, at: float | None = None) -> tuple[asyncio.Future, bool]:
        """Make a stop durable before any signal (intent.py): the intent file beside the
        attempt now, the store record queued behind it (it commits whenever another process
        lets go of eyas.db), the file removed once the record is in. Returns the record's future
        and whether the file was written. On a full disk or a held lock the stop still happens
        (the disk may be full because of this very run); its settlement carries the reason."""
        at = time.time() if at is None else at
        written = intent.write_stop(group.dir, reason, at)
        recorded = self.write_later(
            lambda db: store.record_cancel(db, group.attempt_id, reason, now=at),
            f"recording the stop of run {group.run_id} {group.stage} in eyas.db",
        )
        if written:
            recorded.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() is not None else intent.clear_stop(group.dir)
            )
        return recorded, written

    async def _cancel_group(self, group: Group, reason: str) -> asyncio.Future | None:
        """End a live group on purpose: make the stop durable, then signal, whatever holds the
        store. Returns the store record's future; None when the group was ending already."""
        if group.teardown_since is not None or group.cancel_reason is not None:
            return None
        group.cancel_reason = reason
        recorded, written = self._record_stop(group, reason)
        if not written:  # the store record is the only durable word: a moment for it, no more
            await asyncio.wait({recorded}, timeout=INTENT_WAIT)
        if group.teardown_since is None:
            self._spawn_task(group.teardown(self.grace, reason))
        return recorded

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
                    fields = {"pid": r.pid, "create_time": r.create_time}
                    if r.host:  # a Slurm rank: its node, and its monitor there
                        fields.update(host=r.host, monitor_pid=r.monitor_pid, monitor_create_time=r.monitor_create_time)
                    self.write_later(
                        lambda db, a=attempt_id, r=r.rank, f=fields: store.upsert_rank(db, a, r, **f),
                        f"recording rank {r.rank}'s pid in eyas.db",
                    )
            nodes = group.new_nodes()
            if nodes:
                self.write_later(
                    lambda db, a=attempt_id, n=nodes: db["attempts"].update(a, {"nodes": n}),
                    f"recording the nodes of run {group.run_id} {group.stage}",
                )
            for ex in exits:
                self._record_exit(group, ex)
            if group.teardown_since is None and any(group.counts_as_failure(e) for e in exits):
                first = group.failures()[0]
                self._spawn_task(group.teardown(self.grace, f"{who(first)} failed"))
            self._end_sibling(group)
            if group.settling:
                continue
            if self._sibling_first(group):
                continue
            if not group.alive and not group.tearing and not (group.collecting and group.cancel_reason is None):
                if group.workers and not group.leftovers_ended:
                    # The driver ended: its engine's processes end with it, whatever they do.
                    group.leftovers_ended = True
                    if group.member_pids():
                        self._spawn_task(group.teardown(self.grace, "the driver rank ended"))
                        continue
                self._settle_group(group)

    def _end_sibling(self, group: Group) -> None:
        """A streaming pair fails as one (state/specs.py: STREAM_PAIR): the failure of one half
        (its own ranks', or the watchdog's finding) tears the other down, recorded as a
        consequence; the root cause stays the failing half's."""
        # A rank's own failure, or the watchdog's finding (a teardown for other reasons, say a
        # vLLM driver's leftovers, is no failure).
        failing = group.cancel_reason is None and (group.stuck is not None or group.failures())
        other = specs.sibling(group.stage)
        if not failing or other is None:
            return
        for g in list(self.groups.values()):
            if g.run_id == group.run_id and g.stage == other and g.cancel_reason is None and g.teardown_since is None:
                why = f"{specs.SIBLING_TEARDOWN}{group.stage} failed"
                log.warning("run %s: %s attempt %d %s", g.run_id, g.stage, g.attempt, why)
                self._spawn_task(self._cancel_group(g, why))

    def _sibling_first(self, group: Group) -> bool:
        """A half torn down because the other failed settles after it: by then the store says
        whether the failed half restarts (and this one with it) or ends the run."""
        reason = group.cancel_reason or ""
        return reason.startswith(specs.SIBLING_TEARDOWN) and any(
            g.run_id == group.run_id and g.stage == specs.sibling(group.stage) for g in self.groups.values()
        )

    def watch_hangs(self, now: float) -> None:
        """Start ending every group the watchdog finds stuck (daemon/watchdog.py)."""
        for group in watchdog.check(list(self.groups.values()), now):
            why = watchdog.summary(group)
            log.warning("run %s: %s attempt %d %s", group.run_id, group.stage, group.attempt, why)
            self._emit_state(group.run_id, "stage", "running", why, stage=group.stage, attempt=group.attempt)
            self.record_stuck(group)  # queued before any signal (intent.py)
            self._spawn_task(watchdog.end(group, self.grace, self.record_stuck))

    def record_stuck(self, group: Group) -> None:
        """Write the watchdog's finding (and, once collected, the stacks) on its attempt."""
        stuck = dict(group.stuck)  # as it is now: the loop goes on filling it in
        self.write_later(
            lambda db: store.record_stuck(db, group.attempt_id, stuck),
            f"recording run {group.run_id} {group.stage}'s {stuck['kind']} in eyas.db",
        )

    def _record_worker(self, group: Group, w: Rank) -> None:
        """A TP worker registered: a rank of the attempt from now on; its driver is one too."""
        drivers = [r.rank for r in group.ranks if r.role == "driver"]
        started = w.started_at or time.time()

        def record(db):
            store.upsert_rank(
                db,
                group.attempt_id,
                w.rank,
                pid=w.pid,
                create_time=w.create_time,
                host=self.host,
                device=w.device,
                state="running",
                started_at=started,
                log_path=str(w.log_path),
                role="tp-worker",
                tp_rank=w.tp_rank,
                # Driver rank 0's workers: the daemon watches only its files (contract.tp_dir_name).
                parent_rank=0,
            )
            for rank in drivers:
                store.upsert_rank(db, group.attempt_id, rank, role="driver")
            self._emit_state(
                group.run_id,
                "rank",
                "running",
                f"TP rank {w.tp_rank} (pid {w.pid}) registered",
                stage=group.stage,
                attempt=group.attempt,
            )

        self.write_later(record, f"recording TP rank {w.tp_rank} of run {group.run_id} in eyas.db")

    def _record_exit(self, group: Group, ex: RankExit) -> None:
        """Queue a rank's exit; the settlement writes it again with the group's end."""
        fields = self._exit_fields(group, ex)
        self.write_later(
            lambda db: self._write_exit(db, group, ex, fields), f"recording rank {ex.rank}'s exit in eyas.db"
        )

    @staticmethod
    def _exit_fields(group: Group, ex: RankExit) -> dict:
        state = "failed" if group.counts_as_failure(ex) else ("exited" if not ex.failed else "killed")
        return {
            "state": state,
            "exit_code": ex.exit_code,
            "signal": ex.signal,
            "oom_killed": int(ex.oom_killed),
            "ended_at": ex.time,
            **({"pid": ex.pid} if ex.pid else {}),
        }

    def _write_exit(self, db, group: Group, ex: RankExit, fields: dict) -> None:
        store.upsert_rank(db, group.attempt_id, ex.rank, **fields)
        self._emit_state(group.run_id, "rank", fields["state"], exit_text(ex), stage=group.stage, attempt=group.attempt)

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
        return stage_value(cfg, stage, "backoff", 2.0)

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
            log.warning(
                "stopping with %d group%s not recorded as ended (%s); the next daemon settles them",
                len(self.groups),
                "" if len(self.groups) == 1 else "s",
                self.store.status() or "the store did not answer",
            )
        self._shutdown_done.set()
