"""The scheduler: which attempt starts next (each run's next stage, queued behind the devices other runs hold), recorded in the store before its ranks are spawned.

A pass plans on the store thread (finishing runs whose stages all ended, recording each start
in one transaction) and spawns only after that job committed, so a restarted daemon finds the
attempt, or nothing. Nothing starts while the state directory is full or another process
holds the store; a running stage without a live group starts again only when the store holds
its restart's due time (daemon/settle.py sets it, daemon/intent.py explains why). A streaming
run ([storage] mode = "streaming") starts vocab before extract, then extract and train together,
both recorded in the one transaction (state/specs.py: STREAM_PAIR; workers/extract/stream.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eyas.state import contract, paths, privacy, regenerate, specs, store

from . import diskfull
from .group import Group
from .limits import log_max_mb, set_bounds
from .slurmgroup import SlurmGroup

log = logging.getLogger("eyas.daemon.scheduler")


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


class Scheduler:
    """The scheduling half of the daemon's Core (daemon/core.py)."""

    def _held_devices(self) -> dict[int, int]:
        return {d: g.run_id for g in self.groups.values() for d in g.devices}

    def _devices_for(
        self, cfg: dict, stage: str, world_size: int, held: dict[int, int] | None = None
    ) -> list[int] | None:
        """The GPUs a stage needs, or None when they are busy. [] means CPU only."""
        wanted = cfg.get("resources", {}).get("devices", "auto")
        held = self._held_devices() if held is None else held
        if wanted == "cpu" or not specs.STAGES[stage].gpus or cfg.get("resources", {}).get("executor") == "slurm":
            return []  # a Slurm job's GPUs are Slurm's to give ([slurm] gpus_per_node)
        if isinstance(wanted, list):
            return None if any(d in held for d in wanted) else list(wanted)
        count = self.sampler.gpu.device_count() if self.sampler.gpu_available else 0
        if count == 0:
            return []
        extract = cfg.get("extract", {})
        per_rank = 1
        if stage == "preflight":  # its canaries run the extraction's and the regeneration's engines
            per_rank = self._canary_gpus(cfg)
            if per_rank == 0:
                return []
        elif stage == "extract" and extract.get("backend") == "vllm":
            per_rank = extract.get("tensor_parallel_size", 1)
        elif stage == "regenerate":  # one vLLM engine per rank, at its TP size (else extract's)
            per_rank = regenerate.tensor_parallel_size(cfg)
        elif stage == "evaluate":  # vLLM at the run's TP size, target and draft on every GPU
            per_rank = (cfg.get("evaluate") or {}).get("tensor_parallel_size") or extract.get("tensor_parallel_size", 1)
        need = world_size * per_rank
        free = [d for d in range(count) if d not in held]
        return free[:need] if len(free) >= need else None

    @staticmethod
    def _canary_gpus(cfg: dict) -> int:
        """GPUs the preflight's canaries take (one at a time, so the larger): extract's engine
        (its TP size on the vllm backend, else one GPU), regenerate's; 0 when neither runs."""
        pipeline, extract = cfg.get("pipeline", ()), cfg.get("extract", {})
        need = 0
        if "extract" in pipeline and extract.get("canary", True):
            need = extract.get("tensor_parallel_size", 1) if extract.get("backend") == "vllm" else 1
        if "regenerate" in pipeline and (cfg.get("regenerate") or {}).get("canary", True):
            need = max(need, regenerate.tensor_parallel_size(cfg))
        return need

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
                    await self._spawn_attempt(start)
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
            rows = list(db["stages"].rows_where("run_id = ?", [run_id], order_by="position"))
            stream = specs.streaming(cfg)
            if stream:  # vocab before extract, so that train starts beside it
                by_name = {r["name"]: r for r in rows}
                rows = [by_name[n] for n in specs.stream_order(list(by_name))]
            for s in rows:
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
                if stream and s["name"] == "extract":
                    starts += self._record_pair(db, run, cfg, s, {r["name"]: r for r in rows}["train"], held, now)
                    break
                start = self._record_start(db, run, cfg, s, held)
                if start is not None:
                    starts.append(start)
                    held.update({d: run_id for d in start.devices})
                break
            else:
                self._finish_run(db, run_id, "succeeded", "every stage succeeded or was skipped")
        return starts

    def _record_pair(self, db, run: dict, cfg: dict, ex: dict, tr: dict, held: dict[int, int], now: float) -> list:
        """A streaming run's extract and, unless it is done or not due, its train: both starts in
        this one transaction, or neither while the devices for both are not free. Without GPUs
        enough for both, train shares extract's (one GPU streams too, the two engines side by side)."""
        due = tr["state"] == "pending" or (
            tr["state"] == "running" and tr["restart_at"] is not None and tr["restart_at"] <= now
        )
        if due:
            ex_devices = self._devices_for(cfg, "extract", ex["world_size"] or 1, held)
            if ex_devices is None:
                self._wait_devices(db, run, held)
                return []
            tr_world = tr["world_size"] or 1
            tr_devices = self._devices_for(cfg, "train", tr_world, {**held, **{d: run["id"] for d in ex_devices}})
            if tr_devices is None and len(ex_devices) >= tr_world:
                tr_devices = ex_devices[:tr_world]
            if tr_devices is None:
                self._wait_devices(db, run, held)
                return []
            starts = []
            for s, devices in ((ex, ex_devices), (tr, tr_devices)):
                # The run row again: the first start moved it to running.
                start = self._record_start(db, db["runs"].get(run["id"]), cfg, s, held, devices)
                held.update({d: run["id"] for d in start.devices})
                starts.append(start)
            return starts
        start = self._record_start(db, run, cfg, ex, held)
        if start is None:
            return []
        held.update({d: run["id"] for d in start.devices})
        return [start]

    def _record_start(
        self, db, run: dict, cfg: dict, s: dict, held: dict[int, int], devices: list[int] | None = None
    ) -> _Start | None:
        """Record the start of stage `s` on `devices` (None: those _devices_for finds free)."""
        run_id, stage = run["id"], s["name"]
        world_size = s["world_size"] or 1
        if devices is None:
            devices = self._devices_for(cfg, stage, world_size, held)
        if devices is None:
            self._wait_devices(db, run, held)
            return None
        self.waiting.pop(run_id, None)
        number = (s["attempts"] or 0) + 1
        # Everything under the run's recorded folder, never one rebuilt from its id; a new
        # attempt's folder is one that does not exist yet (Group.spawn creates it exclusively).
        run_dir = paths.run_dir(run, self.home)
        attempt_dir = paths.unused(run_dir / stage / f"attempt-{number}")
        output_dir = Path(run["output_dir"] or run_dir / "out")
        privacy.make_output_dir(output_dir, run_dir)  # the user's umask in a folder they chose
        # The run's, the stage's and the attempt's start in one transaction, before any spawn.
        if run["state"] == "pending":
            self._move_run(run_id, "running", f"starting {stage}")
        if s["state"] == "pending":
            self._move_stage(run_id, stage, "running", "started")
        attempt_id, number = store.new_attempt(
            db, run_id, stage, dir=str(attempt_dir), world_size=world_size, devices=devices
        )
        return _Start(run_id, stage, cfg, attempt_id, number, attempt_dir, world_size, devices, output_dir, run_dir)

    def _wait_devices(self, db, run: dict, held: dict[int, int]) -> None:
        """Say once, on the run, whose devices it waits for."""
        holders = sorted({str(r) for r in held.values()})
        why = f"waiting for devices held by run {', '.join(holders)}"
        if self.waiting.get(run["id"]) != why:
            self.waiting[run["id"]] = why
            db["runs"].update(run["id"], {"reason": why})
            self._emit_state(run["id"], "run", run["state"], why)

    async def _spawn_attempt(self, st: _Start) -> None:
        """Start the ranks of an attempt whose start is recorded, and record them. A Slurm
        attempt's sbatch runs in a thread: slurmctld may take up to slurmjob.TIMEOUT_S to answer,
        and meanwhile the daemon serves its clients (a stop waits for the submission: the
        scheduler's lock stays held, so the job it makes is found and ended)."""
        run_id, stage, attempt_id, number = st.run_id, st.stage, st.attempt_id, st.number
        common = dict(
            run_id=run_id,
            stage=stage,
            attempt_id=attempt_id,
            attempt=number,
            dir=st.attempt_dir,
            world_size=st.world_size,
            output_dir=st.output_dir,
            config_path=st.run_dir / "config.json",
            # Each rank's monitor bounds its log by this (state/logcut.py).
            extra_env={contract.LOG_MAX_MB: f"{log_max_mb(st.cfg, stage):g}"},
        )
        try:
            if (st.cfg.get("resources") or {}).get("executor") == "slurm":
                self.submitting = f"sbatch of run {run_id} {stage} attempt {number}"
                try:
                    group = await asyncio.to_thread(
                        SlurmGroup.submit, **common, python=sys.executable, slurm_cfg=st.cfg.get("slurm") or {}
                    )
                finally:
                    self.submitting = None
            else:
                group = Group.spawn(**common, devices=st.devices)
        except OSError as exc:
            # The daemon could not even start the processes: that is the root cause. (Read
            # here: `exc` is unbound once the except clause ends, before the job runs.)
            now, kind, text = time.time(), type(exc).__name__, str(exc)

            def failed(db):
                store.record_error(
                    db,
                    attempt_id,
                    root_cause=True,
                    **contract.ErrorRecord(type=kind, message=text, traceback="", time=now, source="spawn").fields(),
                )
                store.move_attempt(db, attempt_id, "failed", f"could not start ranks: {text}", now=now)
                self._move_stage(run_id, stage, "failed", f"could not start ranks: {text}", now=now)

            self.write_later(failed, f"recording that run {run_id} {stage} attempt {number} could not start")
            return
        # Supervised from here on, whether or not its rows can be written (a full disk): a
        # restarted daemon finds the ranks by their proc files or environment (intent.py).
        set_bounds(group, st.cfg)
        self.groups[attempt_id] = group
        if isinstance(group, SlurmGroup):
            job = group.job_id
            self.write_later(
                lambda db: db["attempts"].update(attempt_id, {"slurm_job": job}),
                f"recording the Slurm job of run {run_id} {stage} attempt {number}",
            )
        self.record_started(group, group.ranks, f"recording the ranks of run {run_id} {stage} attempt {number}")
        if self.stopping:
            # The daemon began to stop while sbatch ran: the job ends with the others. (A job
            # whose sbatch answers after the daemon is gone is re-adopted by the next one.)
            group.cancel_reason = "the daemon was stopped"
            self._record_stop(group, group.cancel_reason)
            self._spawn_task(group.teardown(self.grace, group.cancel_reason))
        self._emit_state(run_id, "attempt", "running", f"attempt {number} started", stage=stage, attempt=number)
        log.info(
            "run %s: %s attempt %s started with %s ranks (devices %s)",
            run_id,
            stage,
            number,
            st.world_size,
            st.devices or "cpu",
        )
