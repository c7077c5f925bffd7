"""Benchmark: `eyas runs` and `eyas show` as whole processes on a big store.

Set-up: 10,000 runs x 5 stages x 1 attempt x 8 ranks (400,000 rank rows) and 1,000,000
metric rows, about 10% of runs failed with errors. Each command must finish in under
0.5 s wall (median of 5), daemon or not. Also checks that the queries use indexes.

Run: .venv/bin/python tests/bench/bench_history.py   (exit 1 when a target is missed)
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eyas.state import paths, queries, store

RUNS, STAGES, RANKS, METRICS = 10_000, ("prepare", "extract", "vocab", "train", "evaluate"), 8, 1_000_000
TARGET_S = 0.5
REPEAT = 5
EYAS = str(Path(sys.executable).with_name("eyas"))


def build(home: Path) -> int:
    """Fill the store with executemany in one transaction; returns a failed run's id."""
    db = store.open_writer(paths.db_path(home))  # creates the schema
    conn = db.conn
    rng = random.Random(7)
    t0 = 1_700_000_000.0
    runs, stages, attempts, ranks, errors = [], [], [], [], []
    attempt_id = 0
    for rid in range(1, RUNS + 1):
        created = t0 + rid * 600
        state = "failed" if rid % 10 == 3 else ("succeeded" if rid < RUNS - 5 else "running")
        runs.append(
            (
                rid,
                f"run-{rid}",
                f"org/model-{rid % 17}",
                state,
                "train",
                f"/cfg/{rid}.toml",
                f"/out/{rid}",
                created,
                created + 5,
                None if state == "running" else created + 4000,
                rng.uniform(1, 80) * 2**30,
                rng.uniform(100, 5000),
            )
        )
        for pos, name in enumerate(STAGES):
            stages.append(
                (
                    rid,
                    name,
                    pos,
                    "succeeded",
                    1,
                    0,
                    8,
                    created + pos * 800,
                    created + pos * 800 + 790,
                    rng.uniform(100, 5000),
                    rng.uniform(1, 80) * 2**30,
                )
            )
            attempt_id += 1
            adir = str(paths.attempt_dir(rid, name, 1, home))
            attempts.append(
                (
                    attempt_id,
                    rid,
                    name,
                    1,
                    "succeeded",
                    adir,
                    8,
                    "[0,1,2,3,4,5,6,7]",
                    created + pos * 800,
                    created + pos * 800 + 790,
                )
            )
            for r in range(RANKS):
                ranks.append(
                    (
                        attempt_id,
                        rid,
                        name,
                        r,
                        10_000 + r,
                        "exited",
                        0,
                        rng.uniform(1, 80) * 2**30,
                        rng.uniform(100, 5000),
                        f"{adir}/rank-{r}.log",
                    )
                )
            if state == "failed" and name == "train":
                errors.append(
                    (
                        rid,
                        name,
                        attempt_id,
                        1,
                        3,
                        "RuntimeError",
                        "",
                        "Traceback\nRuntimeError",
                        created + 3000,
                        1,
                        "error_file",
                    )
                )
                errors.append((rid, name, attempt_id, 1, 0, "SIGTERM", "group teardown", "", created + 3001, 0, "exit"))
    with conn:
        conn.executemany(
            "INSERT INTO runs (id, name, model, state, current_stage, config_path, output_dir, created_at, "
            "started_at, ended_at, peak_gpu_mem, tok_s) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            runs,
        )
        conn.executemany(
            "INSERT INTO stages (run_id, name, position, state, attempts, restarts, world_size, started_at, "
            "ended_at, tok_s, peak_gpu_mem) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            stages,
        )
        conn.executemany(
            "INSERT INTO attempts (id, run_id, stage, number, state, dir, world_size, devices, started_at, "
            "ended_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
            attempts,
        )
        conn.executemany(
            "INSERT INTO ranks (attempt_id, run_id, stage, rank, pid, state, exit_code, peak_gpu_mem, tok_s, "
            "log_path) VALUES (?,?,?,?,?,?,?,?,?,?)",
            ranks,
        )
        conn.executemany(
            "INSERT INTO errors (run_id, stage, attempt_id, attempt, rank, type, message, traceback, time, "
            "root_cause, source) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            errors,
        )
        names = ("loss", "lr", "tok_s", "gpu_mem")
        conn.executemany(
            "INSERT INTO metrics (time, run_id, stage, attempt, rank, name, value) VALUES (?,?,?,?,?,?,?)",
            ((t0 + i, RUNS - i // 4000, "train", 1, i % 8, names[i % 4], i * 0.001) for i in range(METRICS)),
        )
    conn.close()
    return next(r[0] for r in reversed(runs) if r[3] == "failed")


def plans(home: Path, run_id: int) -> list[str]:
    """EXPLAIN QUERY PLAN of every query the commands run; returns the full scans found."""
    conn = queries.connect(paths.db_path(home))
    seen: list[tuple[str, list]] = []
    real = conn.execute

    class Spy:
        def execute(self, sql, params=()):
            if not sql.lstrip().upper().startswith("PRAGMA"):
                seen.append((sql, list(params)))
            return real(sql, params)

    spy = Spy()
    queries.list_runs(spy, limit=50)
    queries.list_runs(spy, state="failed")
    queries.get_run(spy, run_id)
    queries.errors(spy, run_id)
    bad = []
    for sql, params in dict((s, (s, p)) for s, p in seen).values():
        detail = [row[3] for row in conn.execute("EXPLAIN QUERY PLAN " + sql, params)]
        print(f"  {sql[:90]}{'...' if len(sql) > 90 else ''}\n    -> {'; '.join(detail)}")
        # "SCAN t" without an index reads the whole table; "SCAN t USING INDEX" walks it in order.
        bad += [d for d in detail if d.startswith("SCAN") and "USING" not in d]
    conn.close()
    return bad


def timed(argv: list[str], env: dict) -> float:
    walls = []
    for _ in range(REPEAT):
        t = time.perf_counter()
        p = subprocess.run(argv, env=env, capture_output=True)
        walls.append(time.perf_counter() - t)
        if p.returncode != 0:
            sys.exit(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.decode()[-500:]}")
    return statistics.median(walls)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="eyas-bench-") as tmp:
        home = Path(tmp)
        t = time.perf_counter()
        failed_run = build(home)
        size = paths.db_path(home).stat().st_size / 2**20
        print(
            f"set-up: {RUNS:,} runs, {RUNS * len(STAGES) * RANKS:,} ranks, {METRICS:,} metrics "
            f"in {time.perf_counter() - t:.1f} s ({size:.0f} MiB)"
        )

        print("query plans:")
        scans = plans(home, failed_run)

        env = {**os.environ, "EYAS_HOME": str(home)}
        # Sanity: the commands return what the store holds.
        listed = json.loads(
            subprocess.run([EYAS, "runs", "--json", "--state", "failed"], env=env, capture_output=True).stdout
        )
        assert len(listed) == RUNS // 10, len(listed)
        bare = timed([sys.executable, "-c", "pass"], env)
        print(f"{'command':42} {'median s':>9} {'x python':>9}  target {TARGET_S} s")
        print(f"{'python -c pass':42} {bare:9.3f} {1.0:9.1f}")
        ok = True
        for args in (
            ["runs", "--json", "--limit", "50"],
            ["runs", "--state", "failed", "--json"],
            ["show", str(failed_run), "--json"],
        ):
            wall = timed([EYAS, *args], env)
            passed = wall < TARGET_S
            ok &= passed
            print(f"{'eyas ' + ' '.join(args):42} {wall:9.3f} {wall / bare:9.1f}  {'PASS' if passed else 'FAIL'}")
        if scans:
            print("FAIL: full table scans: " + "; ".join(scans))
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
