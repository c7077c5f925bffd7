"""A deterministic eyas state directory for the TUI's tests and snapshots.

Four runs written through the real store API with fixed times (no daemon): a finished
run, one that failed in training with a root cause and a secondary failure, one running
an 8-rank GPU extraction on its second attempt (with metrics, GPU samples and rank logs),
and a cancelled CPU run; the finished and the failed run carry their train stage's
curves (loss, accuracy, lr, tok/s, GPU memory). Helpers only; the tests live in the other test_tui*.py files.
"""

from __future__ import annotations

import calendar
import json
import math
import os
import shutil
import time
from pathlib import Path

from eyas.state import paths, store

BASE = float(calendar.timegm((2026, 12, 2, 10, 0, 0)))
NOW = BASE + 5 * 3600.0  # 15:00 UTC, the frozen clock of the snapshots
GiB = 2**30
PIPELINE = ["preflight", "prepare", "extract", "vocab", "train", "evaluate"]

TRACEBACK = """Traceback (most recent call last):
  File "/opt/eyas/workers/runtime.py", line 212, in run
    stage.main(ctx)
  File "/opt/eyas/workers/stages/train.py", line 148, in main
    loss = model(batch).loss
           ^^^^^^^^^^^^
  File "/opt/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1775, in _call_impl
    return forward_call(*args, **kwargs)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.11 GiB of which 1.02 GiB is free.
"""
SECONDARY = """Traceback (most recent call last):
  File "/opt/eyas/workers/stages/train.py", line 151, in main
    dist.all_reduce(loss)
RuntimeError: NCCL communicator was aborted on rank 3.
"""


def use_tz_utc(monkeypatch) -> None:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()


def log_lines(rank: int, count: int, start: float, step: float = 1.0, error_at: int | None = None) -> str:
    out = []
    for i in range(count):
        t = time.gmtime(start + i * step)
        ms = (rank * 37 + i * 11) % 1000
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", t) + f",{ms:03d}"
        if error_at is not None and i == error_at:
            out += [
                f"{stamp} ERROR eyas.extract: batch {i} failed on rank {rank}",
                "Traceback (most recent call last):",
                '  File "/opt/eyas/workers/stages/extract.py", line 88, in main',
                "    hidden = capture(batch)",
                "RuntimeError: capture hook saw no hidden states",
            ]
            continue
        out.append(f"{stamp} INFO eyas.extract: rank {rank} batch {i}/400 tokens {(i + 1) * 2048} ({(i + 1) / 4:.1f}%)")
    return "\n".join(out) + "\n"


def build(home: Path, *, fresh: bool = True) -> dict:
    """Write the world under `home`; returns the run ids by nickname."""
    if fresh and home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True, exist_ok=True)
    db = store.open_writer(paths.db_path(home))
    ids = {}
    ids["done"] = _done_run(db, home)
    ids["failed"] = _failed_run(db, home)
    ids["running"] = _running_run(db, home)
    ids["cpu"] = _cpu_run(db, home)
    # The train stages' figures, for the curves (written last, so nothing above changes).
    _train_metrics(db, ids["done"], every=30.0, ranks=8, epochs=3, decay=1500.0, mem=70.0)
    _train_metrics(db, ids["failed"], every=10.0, ranks=4, epochs=0, decay=900.0, mem=74.0)
    db.conn.close()
    return ids


def _train_metrics(db, run_id, *, every, ranks, epochs, decay, mem) -> None:
    """What the train stage and the daemon record over the train attempt's life: rank 0's
    figures (step, loss, accuracy per TTT step, lr; validation at step 0 and each epoch's
    end), the stage's tok/s and each rank's GPU memory, every `every` seconds."""
    start, end = db.execute(
        "SELECT started_at, ended_at FROM attempts WHERE run_id = ? AND stage = 'train' ORDER BY number DESC LIMIT 1",
        [run_id],
    ).fetchone()
    count = int((end - start) // every)
    total_steps = 4 * count
    rows = []

    def row(t, name, value, rank=0):
        rows.append(
            {"time": t, "run_id": run_id, "stage": "train", "attempt": 1, "rank": rank, "name": name, "value": value}
        )

    for k in range(count + 1):
        t, step = start + k * every, 4 * k
        row(t, "step", float(step))
        row(t, "loss", 0.9 + 5.5 * math.exp(-step / decay) + 0.05 * math.sin(k / 3))
        for j in range(3):
            row(t, f"acc_{j}", (1 - math.exp(-step / decay)) * (0.78 - 0.14 * j))
        warm = min(1.0, step / 200)
        row(t, "lr", 3e-4 * warm * 0.5 * (1 + math.cos(math.pi * step / max(1, total_steps))))
        row(t, "tok_s", 9000.0 + 400 * math.sin(k / 7) if k else 0.0, None)
        for r in range(ranks):
            row(t, "gpu_mem_bytes", (mem + 0.5 * r + 2 * math.sin(k / 11 + r) + 4 * k / count) * GiB, r)
        if k == 0 or (epochs and k % (count // epochs) == 0):
            row(t, "val_loss", 1.0 + 5.6 * math.exp(-step / decay))
            row(t, "val_step", float(step))
    store.insert_metrics(db, rows)


def _stage_run(
    db,
    home,
    run_id,
    name,
    t0,
    dur,
    *,
    world=1,
    devices=None,
    state="succeeded",
    tok_s=None,
    peak=None,
    reason="every rank exited 0",
    attempts=1,
    ranks_state="exited",
):
    """One stage with `attempts` attempts, the last ending in `state` (the others failed)."""
    store.move_stage(db, run_id, name, "running", "started", now=t0)
    t = t0
    for number in range(1, attempts + 1):
        last = number == attempts
        adir = paths.attempt_dir(run_id, name, number, home)
        adir.mkdir(parents=True, exist_ok=True)
        aid, _ = store.new_attempt(db, run_id, name, dir=str(adir), world_size=world, devices=devices or [], now=t)
        for r in range(world):
            store.upsert_rank(
                db,
                aid,
                r,
                pid=40000 + 100 * number + r,
                host="gpu-box",
                state="running",
                device=str(devices[r]) if devices else None,
                started_at=t,
                log_path=str(adir / f"rank-{r}.log"),
            )
        end = t + (dur if last else dur / 3)
        if last and state == "running":
            return aid
        for r in range(world):
            store.upsert_rank(
                db,
                aid,
                r,
                state=ranks_state if last else "killed",
                exit_code=0 if last else None,
                signal=None if last else 15,
                ended_at=end,
                tok_s=(tok_s / world if tok_s else None),
                peak_gpu_mem=peak,
            )
        store.move_attempt(db, aid, state if last else "failed", reason if last else "rank 0 failed", now=end)
        t = end + 5
    if tok_s or peak:
        db["stages"].update(store.stage_row(db, run_id, name)["id"], {"tok_s": tok_s, "peak_gpu_mem": peak})
    store.move_stage(db, run_id, name, state, reason, now=t - 5)
    return aid


def _done_run(db, home) -> int:
    t = BASE
    run_id = store.create_run(
        db,
        name="llama-8b-eagle3",
        model="Llama-3.1-8B-Instruct",
        stages=[{"name": s, "world_size": 1} for s in PIPELINE],
        now=t,
    )
    store.move_run(db, run_id, "running", "starting preflight", now=t + 1)
    durations = {"preflight": 12, "prepare": 310, "extract": 2710, "vocab": 45, "train": 7260, "evaluate": 640}
    t += 1
    for s in PIPELINE:
        _stage_run(
            db,
            home,
            run_id,
            s,
            t,
            durations[s],
            world=8 if s in ("extract", "train") else 1,
            devices=list(range(8)) if s in ("extract", "train") else [0],
            tok_s={"extract": 48211.0, "train": 9120.5}.get(s),
            peak={"extract": 61.2 * GiB, "train": 74.8 * GiB}.get(s),
        )
        t += durations[s] + 5
    db["runs"].update(run_id, {"tok_s": 9120.5, "peak_gpu_mem": 74.8 * GiB})
    store.move_run(db, run_id, "succeeded", "every stage succeeded or was skipped", now=t)
    return run_id


def _failed_run(db, home) -> int:
    t = BASE + 3 * 3600
    run_id = store.create_run(
        db, name="qwen-draft", model="Qwen3-32B", stages=[{"name": s, "world_size": 4} for s in PIPELINE], now=t
    )
    store.move_run(db, run_id, "running", "starting preflight", now=t + 1)
    t += 1
    for s, d in (("preflight", 9), ("prepare", 120), ("extract", 1500), ("vocab", 30)):
        _stage_run(
            db,
            home,
            run_id,
            s,
            t,
            d,
            world=4,
            devices=[0, 1, 2, 3],
            tok_s=3050.0 if s == "extract" else None,
            peak=40 * GiB if s == "extract" else None,
        )
        t += d + 5
    why = "rank 1 failed: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    aid = _stage_run(
        db,
        home,
        run_id,
        "train",
        t,
        600,
        world=4,
        devices=[0, 1, 2, 3],
        state="failed",
        reason=why,
        ranks_state="killed",
        peak=78.9 * GiB,
    )
    adir = paths.attempt_dir(run_id, "train", 1, home)
    store.upsert_rank(db, aid, 1, state="failed", exit_code=1, signal=None)
    store.upsert_rank(db, aid, 3, state="failed", exit_code=1, signal=None)
    root = {
        "type": "torch.OutOfMemoryError",
        "message": TRACEBACK.strip().splitlines()[-1].split(": ", 1)[1],
        "traceback": TRACEBACK,
        "rank": 1,
        "pid": 40101,
        "host": "gpu-box",
        "time": t + 598.25,
    }
    (adir / "rank-1.error.json").write_text(json.dumps(root))
    store.record_error(
        db,
        aid,
        rank=1,
        type=root["type"],
        message=root["message"],
        traceback=TRACEBACK,
        time_=t + 598.25,
        root_cause=True,
        source="exception",
        pid=40101,
        host="gpu-box",
        path=str(adir / "rank-1.error.json"),
    )
    store.record_error(
        db,
        aid,
        rank=3,
        type="RuntimeError",
        message="NCCL communicator was aborted on rank 3.",
        traceback=SECONDARY,
        time_=t + 599.5,
        root_cause=False,
        source="exception",
        pid=40103,
        host="gpu-box",
        path=str(adir / "rank-3.error.json"),
    )
    for r in range(4):
        (adir / f"rank-{r}.log").write_text(log_lines(r, 40, t, 15.0, error_at=39 if r in (1, 3) else None))
    store.move_run(db, run_id, "failed", f"train: {why}", now=t + 601)
    return run_id


def _running_run(db, home) -> int:
    t = NOW - 3000
    run_id = store.create_run(
        db,
        name="deepseek-v3-draft",
        model="DeepSeek-V3-tiny",
        stages=[{"name": s, "world_size": 8} for s in PIPELINE],
        now=t,
    )
    store.move_run(db, run_id, "running", "starting preflight", now=t + 1)
    _stage_run(db, home, run_id, "preflight", t + 1, 14, world=1, devices=[0])
    _stage_run(db, home, run_id, "prepare", t + 20, 400, world=1, devices=[0])
    start = NOW - 2400
    # Attempt 1 was SIGKILLed (OOM); attempt 2 runs.
    store.move_stage(db, run_id, "extract", "running", "started", now=start)
    a1dir = paths.attempt_dir(run_id, "extract", 1, home)
    a1dir.mkdir(parents=True, exist_ok=True)
    a1, _ = store.new_attempt(db, run_id, "extract", dir=str(a1dir), world_size=8, devices=list(range(8)), now=start)
    for r in range(8):
        store.upsert_rank(
            db,
            a1,
            r,
            pid=41000 + r,
            host="gpu-box",
            device=str(r),
            started_at=start,
            state="failed" if r == 5 else "killed",
            exit_code=None,
            signal=9 if r == 5 else 15,
            oom_killed=int(r == 5),
            ended_at=start + 600,
            log_path=str(a1dir / f"rank-{r}.log"),
        )
    store.record_error(
        db,
        a1,
        rank=5,
        type="SIGKILL",
        message="rank 5 was killed by SIGKILL (signal 9): the kernel's OOM killer",
        traceback="",
        time_=start + 600,
        root_cause=True,
        source="signal",
        pid=41005,
        host="gpu-box",
        path=None,
    )
    store.move_attempt(db, a1, "failed", "rank 5 failed: SIGKILL", now=start + 600)
    db["stages"].update(store.stage_row(db, run_id, "extract")["id"], {"restarts": 1})
    a2start = start + 610
    a2dir = paths.attempt_dir(run_id, "extract", 2, home)
    a2dir.mkdir(parents=True, exist_ok=True)
    a2, _ = store.new_attempt(db, run_id, "extract", dir=str(a2dir), world_size=8, devices=list(range(8)), now=a2start)
    for r in range(8):
        # pids no process can have (above any pid_max): nothing live is looked up.
        store.upsert_rank(
            db,
            a2,
            r,
            pid=4_900_000 + r,
            host="gpu-box",
            device=str(r),
            started_at=a2start,
            state="running",
            log_path=str(a2dir / f"rank-{r}.log"),
            peak_gpu_mem=(60 + r) * GiB,
        )
        (a2dir / f"rank-{r}.log").write_text(log_lines(r, 240, a2start + 3, 7.0))
    rows = []
    for k in range(300):
        ts = NOW - 299 + k
        for g in range(8):
            rows.append(
                {
                    "time": ts,
                    "run_id": None,
                    "stage": None,
                    "attempt": None,
                    "rank": None,
                    "name": f"gpu{g}.mem_total",
                    "value": 80.0 * GiB,
                }
            )
            rows.append(
                {
                    "time": ts,
                    "run_id": None,
                    "stage": None,
                    "attempt": None,
                    "rank": None,
                    "name": f"gpu{g}.mem_used",
                    "value": (52 + g + 4 * math.sin(k / 30 + g)) * GiB,
                }
            )
        for r in range(8):
            for name, value in (
                ("gpu_mem_bytes", (52 + r + 4 * math.sin(k / 30 + r)) * GiB),
                ("tok_s", 6000 + 800 * math.sin(k / 20 + r) + 40 * r),
                ("cpu_percent", 97.0 + r),
                ("rss_bytes", (11 + r / 4) * GiB),
            ):
                rows.append(
                    {
                        "time": ts,
                        "run_id": run_id,
                        "stage": "extract",
                        "attempt": 2,
                        "rank": r,
                        "name": name,
                        "value": value,
                    }
                )
        for name, value in (("progress", 0.5 + k / 1500), ("eta_s", 1460.0 - k * 2), ("tok_s", 48500.0)):
            rows.append(
                {
                    "time": ts,
                    "run_id": run_id,
                    "stage": "extract",
                    "attempt": 2,
                    "rank": None,
                    "name": name,
                    "value": value,
                }
            )
    store.insert_metrics(db, rows)
    db["stages"].update(store.stage_row(db, run_id, "extract")["id"], {"tok_s": 48500.0, "peak_gpu_mem": 67 * GiB})
    db["runs"].update(run_id, {"tok_s": 48500.0, "peak_gpu_mem": 67 * GiB})
    return run_id


def _cpu_run(db, home) -> int:
    t = BASE + 4 * 3600
    run_id = store.create_run(
        db, name="cpu-smoke", model="tiny-llama", stages=[{"name": "selftest", "world_size": 2}], now=t
    )
    store.move_run(db, run_id, "running", "starting selftest", now=t + 1)
    aid = _stage_run(db, home, run_id, "selftest", t + 1, 30, world=2, state="running")
    adir = paths.attempt_dir(run_id, "selftest", 1, home)
    for r in range(2):
        (adir / f"rank-{r}.log").write_text(log_lines(r, 12, t + 2, 2.0))
        store.upsert_rank(db, aid, r, state="killed", signal=15, ended_at=t + 31, tok_s=1800.0)
    store.move_attempt(db, aid, "cancelled", "stopped by the user", now=t + 31)
    store.move_stage(db, run_id, "selftest", "cancelled", "stopped by the user", now=t + 31)
    store.move_run(db, run_id, "cancelled", "selftest: stopped by the user", now=t + 31)
    return run_id


HUNG_EXITED = NOW - 1030  # when rank 1 of the hung run's train exited 0
HUNG_QUIET = NOW - 1032  # rank 0's last write: nothing since, though it still runs


def add_hung_run(home: Path) -> int:
    """Add, beside build()'s four runs (which it leaves as they are), the run of issue 19: train
    on two GPUs whose rank 1 exited 0 seventeen minutes ago while rank 0 still runs and has
    written nothing since; every sample counted (100%, 0 tok/s). Its stored reason is the stale
    "starting preflight" the Run screen once showed. Returns its id."""
    db = store.open_writer(paths.db_path(home))
    t = NOW - 4000
    run_id = store.create_run(
        db,
        name="llama-hung",
        model="Llama-3.1-8B-Instruct",
        stages=[{"name": s, "world_size": 2} for s in PIPELINE],
        now=t,
    )
    store.move_run(db, run_id, "running", "starting preflight", now=t + 1)
    t += 1
    for s, d in (("preflight", 10), ("prepare", 200), ("extract", 1200), ("vocab", 30)):
        _stage_run(db, home, run_id, s, t, d, world=2, devices=[0, 1])
        t += d + 5
    start = NOW - 2500
    aid = _stage_run(db, home, run_id, "train", start, 0, world=2, devices=[0, 1], state="running")
    store.upsert_rank(db, aid, 0, last_write=HUNG_QUIET, peak_gpu_mem=70 * GiB)
    store.upsert_rank(
        db, aid, 1, state="exited", exit_code=0, ended_at=HUNG_EXITED, last_write=HUNG_EXITED - 1, peak_gpu_mem=69 * GiB
    )
    db["runs"].update(run_id, {"reason": "starting preflight"})
    rows = []
    for k in range(300):
        ts = NOW - 299 + k
        for name, value in (("progress", 1.0), ("eta_s", 0.0), ("tok_s", 0.0)):
            rows.append(
                {
                    "time": ts,
                    "run_id": run_id,
                    "stage": "train",
                    "attempt": 1,
                    "rank": None,
                    "name": name,
                    "value": value,
                }
            )
        for name, value in (("gpu_mem_bytes", 70 * GiB), ("cpu_percent", 100.0), ("rss_bytes", 12 * GiB)):
            rows.append(
                {"time": ts, "run_id": run_id, "stage": "train", "attempt": 1, "rank": 0, "name": name, "value": value}
            )
    rows.append(
        {"time": HUNG_QUIET, "run_id": run_id, "stage": "train", "attempt": 1, "rank": 0, "name": "loss", "value": 1.25}
    )
    store.insert_metrics(db, rows)
    db.conn.close()
    return run_id


def snapshot_home() -> Path:
    """A fixed path, so that paths shown on screen (error files) are the same every run."""
    return Path(os.environ.get("EYAS_TUI_SNAPSHOT_HOME", "/tmp/eyas-tui-snapshot"))


async def until(pilot, predicate, timeout: float = 30.0, what: str = "condition"):
    """Let the app run until `predicate()` is truthy; returns its value. Generous deadlines,
    short pauses: robust on a loaded 2-core machine without fixed sleeps."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.05)


def by_column(table) -> list[dict[str, str]]:
    """A DataTable's rows as {column key: plain text}."""
    keys = [str(k.value) for k in table.columns]
    return [dict(zip(keys, row)) for row in cell_texts(table)]


def cell_texts(table) -> list[list[str]]:
    """A DataTable's cells as plain strings, row by row."""
    return [[str(getattr(c, "plain", c)) for c in table.get_row_at(i)] for i in range(table.row_count)]


def screen_text(app) -> str:
    """What the terminal shows now, as plain text (the compositor's last layout)."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


async def shows(pilot, app, text: str, timeout: float = 20.0) -> str:
    """Wait until the terminal shows `text`; returns the whole screen's text."""
    return await until(pilot, lambda: text in (s := screen_text(app)) and s, timeout, f"the screen to show {text!r}")


MiB = 2**20
# A streaming run's window ([storage] mode = "streaming"): its budget, and what the live run
# (add_streaming_run) shows of it: 6 MiB on disk now, 18 MiB at its peak.
STREAM_BUDGET = 24 * MiB
STREAM_DATASET = 20 * MiB  # the kept run's dataset, inside the budget (its extract summary says so)


def progress_rows(run_id, stage, attempt, rank, records) -> list[dict]:
    """The metric rows the daemon's sampler makes of a rank's progress records (daemon/sampler.py:
    one row per numeric field, at the record's time, under the rank's number)."""
    return [
        {"time": t, "run_id": run_id, "stage": stage, "attempt": attempt, "rank": rank, "name": name, "value": value}
        for t, fields in records
        for name, value in fields.items()
    ]


def extract_record(t: float, window: float, waits: int, wait_s: float) -> tuple[float, dict]:
    """A streaming extract rank's progress figures at `t`, the fields producer.metrics() writes."""
    return t, {"window_bytes": window, "window_budget": STREAM_BUDGET, "extract_waits": waits, "extract_wait_s": wait_s}


def train_record(t: float, waits: int, wait_s: float, freed: int) -> tuple[float, dict]:
    """A streaming train rank's progress figures at `t`, the fields feed.metrics() writes."""
    return t, {"train_waits": waits, "train_wait_s": wait_s, "shards_freed": freed}


def add_streaming_run(home: Path, *, kept: bool = False) -> int:
    """Add, beside build()'s runs, a streaming run of two ranks a stage: extract and train at
    once, with the figures their ranks write into their progress files (extract: the window's
    bytes and budget and its cumulative waits for room; train: its cumulative waits for shards
    and the shards it freed), as the daemon stores them. Returns its id.

    Live (the default): the first attempts of both halves ended (extract failed, train torn
    down with it) and the second ones run, in window mode (train has freed shards, and no
    summary is written yet). Waits, over both attempts and both ranks: extract 2 + 3 + 1 = 6
    (1.25 + 1.5 + 0.55 = 3.3 s), train 1 + 3 + 2 = 6 (0.5 + 1.75 + 0.25 = 2.5 s); the window is
    6 MiB now (rank 1's newest sample), 18 MiB at most (attempt 1), of 24 MiB.
    `kept`: the run succeeded in keep mode: the 20 MiB dataset fit the budget, nothing was freed,
    each train rank waited once (0.5 s), and the extract and train summaries say "keep"."""
    db = store.open_writer(paths.db_path(home))
    t = NOW - 1800
    config = {"pipeline": PIPELINE, "storage": {"mode": "streaming", "budget_gb": STREAM_BUDGET / 1e9}}
    run_id = store.create_run(
        db,
        name="stream-kept" if kept else "stream-live",
        model="tiny-llama",
        stages=[{"name": s, "world_size": 2} for s in PIPELINE],
        config=config,
        now=t,
    )
    store.move_run(db, run_id, "running", "starting preflight", now=t + 1)
    t += 1
    for s, d in (("preflight", 10), ("prepare", 60), ("vocab", 20)):
        _stage_run(db, home, run_id, s, t, d, world=1)
        t += d + 5
    start = t
    rows: list[dict] = []
    if kept:
        for stage in ("extract", "train"):
            _stage_run(db, home, run_id, stage, start, 600, world=2)
        for rank in range(2):
            ex = [extract_record(start + 10, 4 * MiB, 0, 0.0), extract_record(start + 300, STREAM_DATASET, 0, 0.0)]
            rows += progress_rows(run_id, "extract", 1, rank, ex)
            rows += progress_rows(run_id, "train", 1, rank, [train_record(start + 300, 1, 0.5, 0)])
        summaries = {
            "extract": {"streaming": "keep", "dataset_bytes": STREAM_DATASET, "window_budget_bytes": STREAM_BUDGET},
            "train": {"streaming": "keep", "train_waits": 2, "shards_freed": 0},
        }
        for stage, summary in summaries.items():
            db["stages"].update(store.stage_row(db, run_id, stage)["id"], {"summary_json": json.dumps(summary)})
        _stage_run(db, home, run_id, "evaluate", start + 610, 60, world=1)
        store.move_run(db, run_id, "succeeded", "every stage succeeded or was skipped", now=start + 680)
        store.insert_metrics(db, rows)
        db.conn.close()
        return run_id
    # Attempt 1 of each half: extract rank 1 failed, train was torn down with it.
    firsts = {}
    for stage in ("extract", "train"):
        store.move_stage(db, run_id, stage, "running", "started", now=start)
        adir = paths.attempt_dir(run_id, stage, 1, home)
        adir.mkdir(parents=True, exist_ok=True)
        aid, _ = store.new_attempt(db, run_id, stage, dir=str(adir), world_size=2, now=start)
        firsts[stage] = aid
        for r in range(2):
            store.upsert_rank(db, aid, r, pid=4_900_200 + r, state="killed", signal=15, started_at=start)
    for rank, (waits, wait_s) in enumerate(((2, 1.25), (0, 0.0))):
        ex = [extract_record(start + 20, 10 * MiB, 0, 0.0), extract_record(start + 90, 18 * MiB, waits, wait_s)]
        rows += progress_rows(run_id, "extract", 1, rank, ex)
    rows += progress_rows(run_id, "train", 1, 0, [train_record(start + 90, 1, 0.5, 0)])
    store.move_attempt(db, firsts["extract"], "failed", "rank 1 failed: SIGKILL", now=start + 100)
    store.move_attempt(
        db, firsts["train"], "cancelled", "torn down with its streaming sibling: extract rank 1", now=start + 101
    )
    a2 = start + 110
    for stage in ("extract", "train"):
        adir = paths.attempt_dir(run_id, stage, 2, home)
        adir.mkdir(parents=True, exist_ok=True)
        aid, _ = store.new_attempt(db, run_id, stage, dir=str(adir), world_size=2, now=a2)
        for r in range(2):
            store.upsert_rank(
                db,
                aid,
                r,
                pid=4_900_300 + 10 * (stage == "train") + r,
                state="running",
                started_at=a2,
                last_write=NOW - 1,
            )
    for rank, (waits, wait_s) in enumerate(((3, 1.5), (1, 0.55))):
        ex = [extract_record(a2 + 30, 12 * MiB, 1, 0.2), extract_record(NOW - 5 + rank, 6 * MiB, waits, wait_s)]
        rows += progress_rows(run_id, "extract", 2, rank, ex)
    for rank, (waits, wait_s, freed) in enumerate(((3, 1.75, 40), (2, 0.25, 38))):
        tr = [train_record(a2 + 60, 1, 0.1, 0), train_record(NOW - 3, waits, wait_s, freed)]
        rows += progress_rows(run_id, "train", 2, rank, tr)
    store.insert_metrics(db, rows)
    db.conn.close()
    return run_id


def add_cpu_curves(home: Path) -> None:
    """Give the CPU run (4, selftest on no device) a loss and a tok/s curve: what a stage that
    ran without GPUs records (the GPU-memory plot has nothing, and says why)."""
    db = store.open_writer(paths.db_path(home))
    t0 = BASE + 4 * 3600 + 1
    rows = []
    for k in range(30):
        for rank in (0, 1):
            rows.append(
                {
                    "time": t0 + k,
                    "run_id": 4,
                    "stage": "selftest",
                    "attempt": 1,
                    "rank": rank,
                    "name": "loss",
                    "value": 1.0 / (k + 1) + 0.01 * rank,
                }
            )
        rows.append(
            {
                "time": t0 + k + 0.5,
                "run_id": 4,
                "stage": "selftest",
                "attempt": 1,
                "rank": None,
                "name": "tok_s",
                "value": 1800.0 + 50 * math.sin(k),
            }
        )
    store.insert_metrics(db, rows)
    db.conn.close()
