"""Benchmark: the curves on a store with 1,000,000 metric rows for one run.

Set-up: one run whose train stage ran 8 ranks for about 6 hours, written as the daemon writes
it: each second, each rank's cpu_percent, rss_bytes, gpu_mem_bytes and tok_s, the stage's
tok_s, eta_s and progress, and rank 0's training figures (step, loss, acc_0..2, lr, ...),
1,000,000 rows in all.

Measures, in this process with the real app headless at 80x24 (median of 5, alternating):
  1. opening the Run screen without its curves panel (the baseline, RunScreen(curves=False))
     and with it (loss and tok/s read, downsampled in SQL, and drawn): both, their ratio, and
     whether the time with curves meets the target of 0.5 s;
  2. the Metrics screen (all six curves, GPU memory per rank included), reported;
  3. the queries alone, and their plans: every read of the metrics must use a covering index.

Run: .venv/bin/python tests/bench/bench_curves.py   (exit 1 when a target is missed)
"""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from eyas.state import paths, queries, store

ROWS = 1_000_000
RANKS = 8
TRAIN = ("step", "loss", "acc_0", "acc_1", "acc_2", "lr", "grad_norm", "step_tok_s", "epoch", "samples", "tokens")
PER_RANK = ("cpu_percent", "rss_bytes", "gpu_mem_bytes", "tok_s")
STAGE = ("tok_s", "eta_s", "progress")
TARGET_S = 0.5
REPEAT = 5
SIZE = (80, 24)
T0 = 1_800_000_000.0


def build(home: Path) -> tuple[int, int]:
    """The run (finished) and its metrics; returns (run id, seconds of training)."""
    db = store.open_writer(paths.db_path(home))
    per_s = RANKS * len(PER_RANK) + len(STAGE) + len(TRAIN)
    seconds = -(-ROWS // per_s)
    run = store.create_run(db, name="big-train", model="m", stages=[{"name": "train", "world_size": RANKS}], now=T0)
    store.move_run(db, run, "running", "go", now=T0)
    store.move_stage(db, run, "train", "running", "go", now=T0)
    aid, _ = store.new_attempt(db, run, "train", dir=str(home / "a"), world_size=RANKS, now=T0)
    for r in range(RANKS):
        store.upsert_rank(db, aid, r, pid=1000 + r, state="exited", exit_code=0, started_at=T0)
    store.move_attempt(db, aid, "succeeded", "done", now=T0 + seconds)
    store.move_stage(db, run, "train", "succeeded", "done", now=T0 + seconds)
    store.move_run(db, run, "succeeded", "done", now=T0 + seconds)

    def rows():
        for k in range(seconds):
            t = T0 + k
            for r in range(RANKS):
                for name in PER_RANK:
                    yield (
                        t,
                        run,
                        "train",
                        1,
                        r,
                        name,
                        50e9 + 1e8 * math.sin(k / 300 + r) if name != "tok_s" else 1200.0,
                    )
            for name in STAGE:
                yield (t, run, "train", 1, None, name, 9600.0 + 300 * math.sin(k / 600))
            for name in TRAIN:
                yield (t, run, "train", 1, 0, name, float(k) if name == "step" else 0.9 + 5 * math.exp(-k / 4000))

    with db.conn:
        db.conn.executemany(
            "INSERT INTO metrics (time, run_id, stage, attempt, rank, name, value) VALUES (?,?,?,?,?,?,?)",
            itertools.islice(rows(), ROWS),
        )
    count = db.execute("SELECT count(*) FROM metrics").fetchone()[0]
    db.conn.close()
    assert count == ROWS, count
    return run, seconds


def plans(home: Path, run: int) -> list[str]:
    """EXPLAIN QUERY PLAN of every metrics read behind the panel and the Metrics screen."""
    conn = queries.connect(paths.db_path(home))
    seen: list[tuple[str, object]] = []
    real = conn.execute

    class Spy:
        def execute(self, sql, params=()):
            seen.append((sql, params))
            return real(sql, params)

    names = queries.stage_metric_names(Spy(), run, "train")
    queries.stage_curves(Spy(), run, "train", [n for n in names if n in ("loss", "gpu_mem_bytes")])
    queries.stage_curves(Spy(), run, "train", ["tok_s"], ranks=[None], x="step")
    bad = []
    for sql, params in {s: (s, p) for s, p in seen}.values():
        detail = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, params)]
        reads = [d for d in detail if " metrics " in f" {d} "]
        bad += [d for d in reads if "COVERING INDEX" not in d]
        bad += [d for d in detail if "TEMP B-TREE" in d]
    conn.close()
    return bad


async def open_times(home: Path, run: int) -> dict[str, list[float]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    from tui_world import until

    from eyas.tui.app import EyasApp
    from eyas.tui.screens.metrics import MetricsScreen
    from eyas.tui.screens.run import RunScreen
    from eyas.tui.widgets.curves import CurvePlot
    from eyas.tui.widgets.stagecurves import StageCurves

    times: dict[str, list[float]] = {"without": [], "with": [], "metrics": []}
    app = EyasApp(home, socket=home / "no-daemon.sock", connect=False, clock=lambda: T0 + 10 * 86400)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.screen.query("DataTable"), what="the Runs screen")

        async def opened(factory, ready) -> float:
            t = time.perf_counter()
            screen = factory()
            await app.push_screen(screen)
            await until(pilot, lambda: ready(screen), timeout=60, what="the screen's content")
            await pilot.pause()  # one refresh: the content painted
            took = time.perf_counter() - t
            await app.pop_screen()
            await pilot.pause()
            return took

        def run_ready(screen) -> bool:
            return screen.run is not None

        def curves_ready(screen) -> bool:
            return screen.run is not None and bool(screen.query(StageCurves) and screen.query_one(StageCurves).lines)

        def metrics_ready(screen) -> bool:
            # Every curve the store has (no validation ran here): the last one drawn has lines.
            return bool(screen.query(CurvePlot)) and bool(screen.query_one("#plot-gpu_mem", CurvePlot).lines)

        await opened(lambda: RunScreen(run, curves=True), curves_ready)  # warm: imports, page cache
        for _ in range(REPEAT):
            times["without"].append(await opened(lambda: RunScreen(run, curves=False), run_ready))
            times["with"].append(await opened(lambda: RunScreen(run, curves=True), curves_ready))
            times["metrics"].append(await opened(lambda: MetricsScreen([run]), metrics_ready))
    return times


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="eyas-bench-curves-") as tmp:
        home = Path(tmp)
        t = time.perf_counter()
        run, seconds = build(home)
        size = paths.db_path(home).stat().st_size / 2**20
        print(
            f"set-up: {ROWS:,} metric rows for run {run} ({seconds:,} s of an {RANKS}-rank train stage) "
            f"in {time.perf_counter() - t:.1f} s ({size:.0f} MiB)"
        )

        conn = queries.connect(paths.db_path(home))
        for label, kw in (("panel: loss + stage tok/s", {}), ("all six curves", {"all": True})):
            walls = []
            for _ in range(REPEAT):
                t = time.perf_counter()
                names = queries.stage_metric_names(conn, run, "train")
                if kw:
                    wanted = [
                        n for n in names if n in ("loss", "val_loss", "lr", "gpu_mem_bytes") or n.startswith("acc_")
                    ]
                    data = queries.stage_curves(conn, run, "train", wanted)
                else:
                    data = queries.stage_curves(conn, run, "train", ["loss"])
                data.update(queries.stage_curves(conn, run, "train", ["tok_s"], ranks=[None]))
                walls.append(time.perf_counter() - t)
            points = max(len(p) for series in data.values() for p in series.values())
            print(f"query, {label:28} {statistics.median(walls) * 1000:7.1f} ms (at most {points} points a series)")
        conn.close()

        bad = plans(home, run)
        print("query plans: " + ("every metrics read uses a covering index, no sort" if not bad else "; ".join(bad)))

        times = asyncio.run(open_times(home, run))
        base, with_curves, metrics = (statistics.median(times[k]) for k in ("without", "with", "metrics"))
        ok = with_curves <= TARGET_S and not bad
        print(f"{'open, headless ' + 'x'.join(map(str, SIZE)):42} {'median s':>9} {'x without':>10}")
        print(f"{'Run screen without curves (baseline)':42} {base:9.3f} {1.0:10.2f}")
        print(
            f"{'Run screen with curves':42} {with_curves:9.3f} {with_curves / base:10.2f}  "
            f"target <= {TARGET_S} s: {'PASS' if with_curves <= TARGET_S else 'FAIL'}"
        )
        print(f"{'Metrics screen (six curves)':42} {metrics:9.3f} {metrics / base:10.2f}  (reported)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
