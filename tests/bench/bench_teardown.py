"""Group teardown: time from SIGKILL of one of 8 ranks until the last rank is gone.

Target: median of 10 trials <= 1 s. Baseline, measured in the same run: the test itself
SIGKILLs 8 bare sleeping processes and waits until they are gone, the floor no supervisor
can beat. Run: python tests/bench/bench_teardown.py
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from daemon_harness import Daemon, bench_home, selftest_toml, wait_for  # noqa: E402

RANKS = 8
TRIALS = 10
TARGET_S = 1.0


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def baseline_trial() -> float:
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(RANKS)]
    time.sleep(0.3)
    t0 = time.perf_counter()
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()
    return time.perf_counter() - t0


def eyas_trial(d: Daemon, n: int) -> float:
    run_id = d.submit(
        selftest_toml(f"teardown-{n}", ranks=RANKS, options={"steps": 100000, "step_time": 0.05}), f"t{n}.toml"
    )
    pids = wait_for(lambda: (p := [r["pid"] for r in d.ranks(run_id)]) and len(p) == RANKS and all(p) and p, 60)
    every = set(pids)
    time.sleep(0.5)
    t0 = time.perf_counter()
    os.kill(pids[3], signal.SIGKILL)
    while not all(gone(p) for p in every):
        time.sleep(0.002)
    elapsed = time.perf_counter() - t0
    d.wait_run(run_id)
    return elapsed


def main() -> int:
    home = bench_home()
    d = Daemon(home).start()
    try:
        eyas = [eyas_trial(d, n) for n in range(TRIALS)]
    finally:
        d.cleanup()
    base = [baseline_trial() for _ in range(TRIALS)]
    med, bmed = statistics.median(eyas), statistics.median(base)
    print(f"teardown of {RANKS} ranks after one SIGKILL, {TRIALS} trials")
    print(f"  eyas:     median {med * 1000:.0f} ms (min {min(eyas) * 1000:.0f}, max {max(eyas) * 1000:.0f})")
    print(f"  baseline: median {bmed * 1000:.1f} ms (the bench kills {RANKS} bare processes itself)")
    print(
        f"  ratio eyas/baseline: {med / bmed:.1f}x; target median <= {TARGET_S:.1f} s: "
        f"{'PASS' if med <= TARGET_S else 'FAIL'}"
    )
    return 0 if med <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
