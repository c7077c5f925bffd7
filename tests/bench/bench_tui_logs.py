"""The TUI's Logs screen on big logs: 8 ranks, each with a 1,000,000-line log.

Measures, in a fresh process running the real app headless at 160x48:
  1. the time from opening the Logs screen (one rank, following) to its first paint, and the
     process's peak RSS: targets <= 1.5 s and <= 400 MB;
  2. the same for the all-ranks merged view (reported; it indexes all 8 files first);
  3. follow mode while 8 writer processes append 5,000 lines/s each: the lag between a line's
     write time (stamped in the line) and its appearance on screen, sampled every 0.1 s over
     the window; target: at most 1 s. Also the redraw rate, which the screen bounds.
Baselines measured in the same run, printed as ratios: a raw read of the same rank file
counting newlines (`wc -l`), and the app's own RSS before the Logs screen opened. The files
are read once first, so that both sides run from the page cache.

Run: python tests/bench/bench_tui_logs.py [--lines N] [--seconds S]
The generated logs are kept in $EYAS_BENCH_DIR (default /tmp/eyas-bench-tui) for reruns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

RANKS = 8
OPEN_TARGET_S = 1.5
RSS_TARGET_MB = 400
LAG_TARGET_S = 1.0
SIZE = (160, 48)

WRITER = r"""
import sys, time
path, rank, rate, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
n = 0
t0 = time.monotonic()
with open(path, "a") as out:
    while True:
        elapsed = time.monotonic() - t0
        if elapsed >= seconds:
            break
        target = int(rate * elapsed)
        if target > n:
            now = time.time()
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now * 1000) % 1000:03d}"
            out.write("".join(f"{stamp} INFO bench.follow: r{rank} line {i} @{now:.3f}\n" for i in range(n, target)))
            out.flush()
            n = target
        time.sleep(0.01)
"""


def generate(folder: Path, lines: int) -> list[Path]:
    """8 rank logs of `lines` Python-logging lines each, stamped over the last days."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / f"complete-{lines}"
    paths = [folder / f"rank-{r}.log" for r in range(RANKS)]
    if marker.exists():
        sizes = json.loads(marker.read_text())
        for p, size in zip(paths, sizes):
            if p.stat().st_size != size:
                os.truncate(p, size)  # a previous run's follow phase appended to it
        return paths
    start = time.time() - 3 * 86400
    for r, p in enumerate(paths):
        with open(p, "w") as out:
            for base in range(0, lines, 100_000):
                chunk = []
                for i in range(base, min(lines, base + 100_000)):
                    t = start + i * 0.1 + r * 0.013
                    lt = time.localtime(t)
                    chunk.append(
                        f"{lt.tm_year}-{lt.tm_mon:02d}-{lt.tm_mday:02d} {lt.tm_hour:02d}:{lt.tm_min:02d}:"
                        f"{lt.tm_sec:02d},{int(t * 1000) % 1000:03d} INFO eyas.extract: rank {r} batch {i} "
                        f"tokens {(i + 1) * 2048} loss {1 / (i + 1):.5f}\n"
                    )
                out.write("".join(chunk))
    marker.write_text(json.dumps([p.stat().st_size for p in paths]))
    return paths


def build_store(home: Path, logs: Path) -> int:
    from eyas.state import paths, store

    if home.exists():
        shutil.rmtree(home)
    home.mkdir(parents=True)
    db = store.open_writer(paths.db_path(home))
    t = time.time() - 3 * 86400
    run_id = store.create_run(
        db, name="bench-logs", model="bench", stages=[{"name": "extract", "world_size": RANKS}], now=t
    )
    store.move_run(db, run_id, "running", "started", now=t)
    store.move_stage(db, run_id, "extract", "running", "started", now=t)
    aid, _ = store.new_attempt(db, run_id, "extract", dir=str(logs), world_size=RANKS, now=t)
    for r in range(RANKS):
        store.upsert_rank(db, aid, r, pid=4_900_000 + r, state="running", log_path=str(logs / f"rank-{r}.log"))
    db.conn.close()
    return run_id


def raw_count(path: Path) -> tuple[float, int]:
    """The baseline: read the file and count its newlines, as `wc -l` does."""
    t0 = time.perf_counter()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            n += chunk.count(b"\n")
    return time.perf_counter() - t0, n


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


# -- the measuring child -----------------------------------------------------------------------


async def measure(home: Path, run_id: int, logs: Path, rate: int, seconds: float) -> dict:
    from eyas.tui.app import EyasApp
    from eyas.tui.screens.logs import LogsScreen
    from eyas.tui.widgets.logview import LogView

    out: dict = {}
    for r in range(RANKS):  # warm the page cache: measure the TUI's work, not the disk's
        raw_count(logs / f"rank-{r}.log")
    out["raw_read_s"], out["lines"] = raw_count(logs / "rank-0.log")
    app = EyasApp(home, socket=home / "no-daemon.sock")
    async with app.run_test(size=SIZE) as pilot:
        while not app.screen.query("DataTable"):
            await pilot.pause(0.01)
        await pilot.pause(0.2)
        out["app_rss_mb"] = current_rss_mb()

        async def painted(view, timeout=120.0):
            deadline = time.monotonic() + timeout
            while view.first_paint is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("no paint")
                await asyncio.sleep(0.002)
            return view.first_paint

        t0 = time.perf_counter()
        await app.push_screen(LogsScreen(run_id, "extract", rank=0))
        view = app.screen.query_one(LogView)
        out["open_s"] = await painted(view) - t0
        out["open_rss_mb"] = current_rss_mb()
        out["peak_rss_after_open_mb"] = rss_mb()
        last = view.visible_rows()[-1]
        out["tail_line"] = last.line

        # The merged view: every rank's log must be indexed before the first merged paint.
        screen = app.screen
        t0 = time.perf_counter()
        await pilot.press("a")
        while not (view.model is not None and view.model.merged and view.visible_rows()):
            await asyncio.sleep(0.005)
        out["merged_open_s"] = time.perf_counter() - t0
        out["merged_total"] = view.model.total()
        out["peak_rss_after_merged_mb"] = rss_mb()

        # Follow mode under 8 writers.
        assert view.follow
        writers = [
            subprocess.Popen(
                [sys.executable, "-c", WRITER, str(logs / f"rank-{r}.log"), str(r), str(rate), str(seconds)]
            )
            for r in range(RANKS)
        ]
        stamp = re.compile(r"@(\d+\.\d+)$")
        lags, paints0, t0 = [], view.paints, time.monotonic()
        try:
            await pilot.pause(0.5)
            while any(w.poll() is None for w in writers):
                rows = view._rows
                m = stamp.search(rows[-1].text) if rows else None
                if m:
                    lags.append(time.time() - float(m.group(1)))
                await asyncio.sleep(0.1)
        finally:
            for w in writers:
                w.wait()
        window = time.monotonic() - t0
        out["follow_paints_per_s"] = (view.paints - paints0) / window
        out["follow_lag_samples"] = len(lags)
        out["follow_lag_p50_s"] = statistics.median(lags) if lags else None
        out["follow_lag_p95_s"] = statistics.quantiles(lags, n=20)[18] if len(lags) >= 20 else None
        out["follow_lag_max_s"] = max(lags) if lags else None
        out["peak_rss_mb"] = rss_mb()
        del screen
    return out


def child(argv: list[str]) -> int:
    home, run_id, logs, rate, seconds = Path(argv[0]), int(argv[1]), Path(argv[2]), int(argv[3]), float(argv[4])
    result = asyncio.run(measure(home, run_id, logs, rate, seconds))
    print("RESULT " + json.dumps(result))
    return 0


# -- the report ----------------------------------------------------------------------------------


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=10.0, help="length of the follow phase")
    ap.add_argument("--rate", type=int, default=5_000, help="lines/s per writer in the follow phase")
    args = ap.parse_args()
    root = Path(os.environ.get("EYAS_BENCH_DIR", "/tmp/eyas-bench-tui"))
    t = time.perf_counter()
    logs_dir = root / f"logs-{args.lines}"
    paths = generate(logs_dir, args.lines)
    print(
        f"{RANKS} rank logs of {args.lines:,} lines ({sum(p.stat().st_size for p in paths) / 2**20:,.0f} MiB) "
        f"ready in {time.perf_counter() - t:.1f} s"
    )
    home = root / "home"
    run_id = build_store(home, logs_dir)
    env = {**os.environ, "EYAS_HOME": str(home), "XDG_RUNTIME_DIR": str(root / "rt")}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(home), str(run_id), str(logs_dir), str(args.rate), str(args.seconds)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
        return 1
    r = json.loads(line[len("RESULT ") :])
    generate(logs_dir, args.lines)  # cut the appended lines off again

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    ok_open = r["open_s"] <= OPEN_TARGET_S
    ok_rss = r["peak_rss_mb"] <= RSS_TARGET_MB
    lag = r["follow_lag_max_s"]
    ok_lag = lag is not None and lag <= LAG_TARGET_S
    print(f"Logs screen, rank 0 of {RANKS}, following ({r['lines']:,} lines; tail line {r['tail_line']:,}):")
    print(
        f"  open -> first paint:  {r['open_s']:.3f} s   (baseline raw read + newline count of the same file "
        f"{r['raw_read_s']:.3f} s; ratio {r['open_s'] / r['raw_read_s']:.1f}x)  target <= {OPEN_TARGET_S} s: "
        f"{verdict(ok_open)}"
    )
    print(
        f"  RSS after first paint: {r['open_rss_mb']:.0f} MB   (baseline: the app before opening it "
        f"{r['app_rss_mb']:.0f} MB; ratio {r['open_rss_mb'] / r['app_rss_mb']:.2f}x)"
    )
    print(
        f"All ranks merged by time ({r['merged_total']:,} lines): first paint {r['merged_open_s']:.2f} s "
        f"(ratio to the raw read of one file {r['merged_open_s'] / r['raw_read_s']:.1f}x; "
        f"{RANKS} files to index)"
    )
    print(
        f"Follow, merged view, {RANKS} x {args.rate:,} lines/s for {args.seconds:.0f} s: lag p50 "
        f"{r['follow_lag_p50_s']:.3f} s, p95 {r['follow_lag_p95_s']:.3f} s, max {lag:.3f} s over "
        f"{r['follow_lag_samples']} samples  target max <= {LAG_TARGET_S} s: {verdict(ok_lag)}"
    )
    print(f"  redraws while following: {r['follow_paints_per_s']:.1f}/s (bounded by the screen's 10 Hz timer)")
    print(
        f"Peak RSS of the whole run: {r['peak_rss_mb']:.0f} MB (after the single-rank open "
        f"{r['peak_rss_after_open_mb']:.0f} MB; baseline app {r['app_rss_mb']:.0f} MB, ratio "
        f"{r['peak_rss_mb'] / r['app_rss_mb']:.2f}x)  target <= {RSS_TARGET_MB} MB: {verdict(ok_rss)}"
    )
    return 0 if ok_open and ok_rss and ok_lag else 1


if __name__ == "__main__":
    sys.exit(main())
