"""Soak: the demo's 2-rank train stage (DDP and FSDP) and the whole demo pipeline, back to back, half
of the runs with busy-loop processes competing for every core.

This is where the training-exit deadlock (a gloo ProcessGroup freed under the GIL) and a SIGABRT
after FSDP training finished showed: 3 hangs in 12 DDP runs and 1 SIGABRT in 6 FSDP runs when the
ranks fought for the CPU, none on a quiet machine. Each run is a real submission to one real
daemon. For every run the bench records:
- a hang: the run has not ended `--timeout` seconds after submission (it is then stopped);
- a straggler: the root cause eyas recorded is `Straggler` (a rank that did not exit after its
  stage function returned, or after its peers finished);
- failed after its work was done: a stage recorded failed although every rank's done.json says
  its stage function returned 0;
- each rank's exit lag: from its done.json (written when its stage function had returned and its
  outputs were durable) to the exit its monitor recorded in exit.json.
Targets: hangs, stragglers and stages failed after their work was done all 0; the slowest exit lag
under 2 s. Quiet and loaded runs are reported apart, with the loaded / quiet ratio of the median
run time measured in the same session.
Run: python tests/bench/bench_soak.py [--ddp 50] [--fsdp 20] [--demo 5] [--epochs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from daemon_harness import Daemon, bench_home  # noqa: E402

from eyas.cli.demo import DEMO_TOML, FIT_STEPS  # noqa: E402
from eyas.state import queries  # noqa: E402

EXIT_LAG_TARGET_S = 2.0
INPUT_STAGES = ("prepare", "extract", "vocab")


@dataclass
class Outcome:
    kind: str
    loaded: bool
    state: str
    seconds: float
    hang: bool = False
    straggler: bool = False
    failed_after_done: bool = False
    root_cause: str | None = None
    exit_lags: list[float] = field(default_factory=list)


def demo_toml(*, output_dir: Path, pipeline: list[str], epochs: int | None = None, strategy: str = "ddp") -> str:
    """The demo's own config with the soak's changes: where it writes, which stages, no automatic
    restart (a restart would hide the failure being counted), and for train soaks no preflight."""
    text = DEMO_TOML.read_text()
    text = re.sub(r"^pipeline = \[.*\]$", f"pipeline = {json.dumps(pipeline)}", text, count=1, flags=re.M)
    text = re.sub(
        r'^name = "demo"$',
        f'name = "soak"\noutput_dir = "{output_dir}"' + ("\npreflight = false" if "prepare" not in pipeline else ""),
        text,
        count=1,
        flags=re.M,
    )
    text = re.sub(r'^strategy = "ddp"', f'strategy = "{strategy}"', text, count=1, flags=re.M)
    if epochs is not None:
        text = re.sub(r"^epochs = \d+", f"epochs = {epochs}", text, count=1, flags=re.M)
    if "train" not in pipeline:  # a [stages.X] table for a stage not in the pipeline is refused
        text = text[: text.index("[stages.train]")]
    return re.sub(r"^max_restarts = 1$", "max_restarts = 0", text, count=1, flags=re.M)


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def measure(d: Daemon, toml: str, kind: str, loaded: bool, timeout: float) -> Outcome:
    t0 = time.monotonic()
    run_id = d.submit(toml, f"{kind}-{time.monotonic_ns()}.toml")
    hang = False
    try:
        run = d.wait_run(run_id, timeout=timeout)
    except AssertionError as exc:
        hang = True
        print(f"  run {run_id} did not end in {timeout:.0f} s:\n{str(exc)[-4000:]}", flush=True)
        d.request("stop", run=run_id)
        run = d.wait_run(run_id, timeout=120)
    out = Outcome(kind, loaded, run["state"], time.monotonic() - t0, hang=hang)
    db = d.reader()
    try:
        errors = queries.errors(db, run_id)
    finally:
        db.conn.close()
    root = next((e for e in errors if e.get("root_cause")), None)
    if root is not None:
        out.root_cause = f"{root['stage']}: {root['type']}: {root['message'][:200]}"
        out.straggler = root["type"] == "Straggler"
    for stage in run["stages"]:
        for attempt in stage["attempt_list"]:
            adir = Path(attempt["dir"])
            done = {
                r["rank"]: _json(adir / f"rank-{r['rank']}.done.json")
                for r in attempt["ranks"]
                if r.get("role") != "tp-worker"
            }
            for r, rec in done.items():
                ended = _json(adir / f"rank-{r}.exit.json")
                if rec is not None and ended is not None:
                    out.exit_lags.append(float(ended["time"]) - float(rec["time"]))
            if (
                attempt["state"] == "failed"
                and done
                and all(rec is not None and rec.get("exit_code") == 0 for rec in done.values())
            ):
                out.failed_after_done = True
    return out


def base_inputs(d: Daemon, home: Path, timeout: float) -> Path:
    """prepare, extract and vocab of the demo once; every train soak reads them."""
    base = home / "base"
    outcome = measure(d, demo_toml(output_dir=base, pipeline=list(INPUT_STAGES)), "inputs", False, timeout)
    if outcome.state != "succeeded":
        raise SystemExit(f"building the train inputs failed: {outcome.root_cause}")
    return base


def train_dir(base: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for stage in INPUT_STAGES:  # read-only inputs: links, so 70 runs do not copy them 70 times
        (dest / stage).symlink_to(base / stage)
    return dest


def report(outcomes: list[Outcome]) -> bool:
    print(
        f"\n{'kind':<8} {'load':<7} {'runs':>4} {'ok':>4} {'hangs':>5} {'stragglers':>10} "
        f"{'failed-after-done':>17} {'median s':>8} {'slowest exit lag s':>18}"
    )
    ok = True
    for kind in dict.fromkeys(o.kind for o in outcomes):
        for loaded in (False, True):
            rows = [o for o in outcomes if o.kind == kind and o.loaded == loaded]
            if not rows:
                continue
            lags = [lag for o in rows for lag in o.exit_lags]
            print(
                f"{kind:<8} {'busy' if loaded else 'quiet':<7} {len(rows):>4} "
                f"{sum(o.state == 'succeeded' for o in rows):>4} {sum(o.hang for o in rows):>5} "
                f"{sum(o.straggler for o in rows):>10} {sum(o.failed_after_done for o in rows):>17} "
                f"{statistics.median(o.seconds for o in rows):>8.1f} {max(lags, default=float('nan')):>18.3f}"
            )
        quiet = [o.seconds for o in outcomes if o.kind == kind and not o.loaded]
        busy = [o.seconds for o in outcomes if o.kind == kind and o.loaded]
        if quiet and busy:
            print(f"{kind}: median run time busy / quiet = {statistics.median(busy) / statistics.median(quiet):.2f}")
    for o in outcomes:
        if o.state != "succeeded":
            print(f"  {o.kind} ({'busy' if o.loaded else 'quiet'}) {o.state}: {o.root_cause}")
    lags = [lag for o in outcomes for lag in o.exit_lags]
    hangs, stragglers = sum(o.hang for o in outcomes), sum(o.straggler for o in outcomes)
    after_done = sum(o.failed_after_done for o in outcomes)
    slowest = max(lags, default=float("nan"))
    print(
        f"\nhangs {hangs}, stragglers {stragglers}, stages failed after their work was done {after_done} "
        f"(target: all 0)"
    )
    print(
        f"rank exits measured {len(lags)}: median {statistics.median(lags) if lags else float('nan'):.3f} s, "
        f"slowest {slowest:.3f} s = {slowest / EXIT_LAG_TARGET_S:.2f} of the {EXIT_LAG_TARGET_S:g} s target"
    )
    ok = hangs == stragglers == after_done == 0 and lags and slowest < EXIT_LAG_TARGET_S
    failed = sum(o.state != "succeeded" for o in outcomes)
    print(f"runs {len(outcomes)}, failed {failed}: {'PASS' if ok and not failed else 'FAIL'}")
    return bool(ok and not failed)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ddp", type=int, default=50)
    p.add_argument("--fsdp", type=int, default=20)
    p.add_argument("--demo", type=int, default=5)
    p.add_argument("--epochs", type=int, default=2, help="train epochs of the train soaks (the demo keeps 16)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds after which a train run counts as hung")
    p.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="busy loops during a loaded run")
    a = p.parse_args()
    home = bench_home()
    subprocess.run(
        [sys.executable, "-m", "eyas.workers.models.assets", str(home / "assets"), "--fit-steps", str(FIT_STEPS)],
        check=True,
        stdin=subprocess.DEVNULL,
        capture_output=True,
    )
    d = Daemon(home, grace=5.0).start()
    outcomes: list[Outcome] = []
    try:
        base = base_inputs(d, home, a.timeout * 3)
        plan = (
            [("ddp", i) for i in range(a.ddp)]
            + [("fsdp", i) for i in range(a.fsdp)]
            + [("demo", i) for i in range(a.demo)]
        )
        for n, (kind, i) in enumerate(plan):
            loaded = i % 2 == 1
            dest = home / "soak" / f"{kind}-{i}"
            if kind == "demo":
                toml, timeout = (
                    demo_toml(output_dir=dest, pipeline=["prepare", "extract", "vocab", "train", "evaluate"]),
                    a.timeout * 4,
                )
            else:
                toml, timeout = (
                    demo_toml(output_dir=train_dir(base, dest), pipeline=["train"], epochs=a.epochs, strategy=kind),
                    a.timeout,
                )
            loops = busy_loops(a.busy) if loaded else []
            try:
                o = measure(d, toml, kind, loaded, timeout)
            finally:
                for proc in loops:
                    proc.kill()
                    proc.wait()
            outcomes.append(o)
            lag = max(o.exit_lags, default=float("nan"))
            print(
                f"[{n + 1}/{len(plan)}] {kind} {'busy' if loaded else 'quiet'}: {o.state} in {o.seconds:.1f} s, "
                f"slowest exit lag {lag:.3f} s" + (f" ({o.root_cause})" if o.root_cause else ""),
                flush=True,
            )
            if kind != "demo":
                shutil.rmtree(dest, ignore_errors=True)
    finally:
        d.cleanup()
    passed = report(outcomes)
    shutil.rmtree(home, ignore_errors=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
