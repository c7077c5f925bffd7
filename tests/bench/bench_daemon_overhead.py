"""Daemon overhead under log floods: 8 ranks each print 20,000 lines/s for 20 s.

Targets: the daemon's CPU time / wall time <= 0.10 while a client is subscribed to the
logs; every line reaches its rank's log exactly once; the subscriber sees lines within 1 s.
For scale, the ranks' own CPU time over the same window is printed beside it (the daemon's
share of the work).

The flood runs twice in one run: first with the watchdog's process watch off (EYAS_WATCH=off,
daemon/sampler.py: no state, CPU times or title per process, no phase bookkeeping: the daemon as
it was before phases had evidence), then as shipped, and the ratio of their CPU / wall is the
cost of watching every process's state and each phase's evidence.
Run: python tests/bench/bench_daemon_overhead.py [seconds]
"""

from __future__ import annotations

import re
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from daemon_harness import Daemon, bench_home, selftest_toml, wait_for  # noqa: E402

from eyas.wire.client import Client  # noqa: E402

RANKS = 8
RATE = 20_000
CPU_TARGET = 0.10
LATENCY_TARGET = 1.0


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def main() -> int:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
    results = {}
    for label, env in (("watch off (before)", {"EYAS_WATCH": "off"}), ("watch on", {})):
        print(f"== {label}")
        share, ok = flood(seconds, env)
        results[label] = share
        if not ok:
            return 1
    before, after = results.values()
    print(f"daemon CPU / wall, watch on / watch off: {after / before:.3f} ({after:.3f} / {before:.3f})")
    return 0


def flood(seconds: float, env: dict) -> tuple[float, bool]:
    """One flood; (the daemon's CPU / wall, whether every target was met)."""
    home = bench_home()
    d = Daemon(home, extra_env=env).start()
    daemon_proc = psutil.Process(d.proc.pid)
    latencies: list[float] = []
    received = Counter()
    stop = threading.Event()
    try:
        run_id = d.submit(
            selftest_toml("flood", ranks=RANKS, options={"lines_per_sec": RATE, "duration": seconds, "step_time": 0.5})
        )
        client = Client(d.socket, timeout=None)
        events = client.subscribe(["log"], run=run_id)

        def consume():
            for ev in events:
                now = time.time()
                text = ev.data["text"]
                received[ev.data["rank"]] += text.count("\n")
                tail = text.rstrip("\n").rpartition("\n")[2]
                m = re.search(r"@(\d+\.\d+)$", tail)
                if m:
                    latencies.append(now - float(m.group(1)))
                if stop.is_set():
                    break

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        pids = wait_for(lambda: (p := [r["pid"] for r in d.ranks(run_id)]) and len(p) == RANKS and all(p) and p, 60)
        ranks = [psutil.Process(p) for p in pids]
        monitors = [p.parent() for p in ranks]  # each rank's monitor, which also bounds its log
        time.sleep(1.0)  # past start-up, into the flood
        t0, d0 = time.monotonic(), cpu_seconds(daemon_proc)
        r0 = sum(cpu_seconds(p) for p in ranks)
        m0 = sum(cpu_seconds(p) for p in monitors)
        window = seconds - 3.0
        time.sleep(window)
        wall = time.monotonic() - t0
        daemon_cpu = cpu_seconds(daemon_proc) - d0
        ranks_cpu = sum(cpu_seconds(p) for p in ranks if p.is_running()) - r0
        monitors_cpu = sum(cpu_seconds(p) for p in monitors if p.is_running()) - m0
        run = d.wait_run(run_id, timeout=seconds + 120)
        stop.set()
        client.close()
        attempt_dir = Path(run["stages"][0]["attempt_list"][0]["dir"])
        complete = True
        for r in range(RANKS):
            text = (attempt_dir / f"rank-{r}.log").read_text()
            numbers = Counter(int(n) for n in re.findall(rf"^r{r} line (\d+) @", text, re.M))
            expected = int(RATE * seconds)
            ok = len(numbers) == expected and set(numbers) == set(range(expected)) and max(numbers.values()) == 1
            complete &= ok
            if not ok:
                print(f"  rank {r}: {len(numbers)} distinct lines of {expected}, max repeats {max(numbers.values())}")
    finally:
        d.cleanup()
    share = daemon_cpu / wall
    lat_max = max(latencies) if latencies else float("inf")
    lat_p99 = statistics.quantiles(latencies, n=100)[98] if len(latencies) > 100 else lat_max
    print(f"{RANKS} ranks x {RATE:,} lines/s for {seconds:.0f} s ({run['state']}); measured over {wall:.1f} s")
    print(
        f"  daemon CPU / wall:   {share:.3f}  (target <= {CPU_TARGET:.2f}: {'PASS' if share <= CPU_TARGET else 'FAIL'})"
    )
    print(
        f"  ranks' CPU / wall:   {ranks_cpu / wall:.2f}  (daemon/ranks CPU ratio {daemon_cpu / max(ranks_cpu, 1e-9):.3f})"
    )
    print(f"  monitors' CPU / wall: {monitors_cpu / wall:.4f}  (all {RANKS} together)")
    print(f"  every line in its log exactly once: {'PASS' if complete else 'FAIL'}")
    print(
        f"  subscriber latency:  p99 {lat_p99 * 1000:.0f} ms, max {lat_max * 1000:.0f} ms over {len(latencies)} chunks, "
        f"{sum(received.values()):,} lines streamed (target max <= {LATENCY_TARGET:.0f} s: "
        f"{'PASS' if lat_max <= LATENCY_TARGET else 'FAIL'})"
    )
    return share, share <= CPU_TARGET and complete and lat_max <= LATENCY_TARGET


if __name__ == "__main__":
    sys.exit(main())
