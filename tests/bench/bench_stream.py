"""Streaming against offline ([storage] mode = "streaming"): wall time and peak disk of extract → train through a real daemon.

The demo's target and chats (eyas demo's assets, built once into a temp dir and kept), the
demo's settings with `--epochs` epochs (default 1), extract and train at `--ranks` ranks each,
no preflight and no evaluate, so that only the two stages are measured:

- offline: extract, then train; its wall time (extract's start to train's end) and each stage's
  own time, and the size of the hidden states it leaves;
- streaming: both at once inside a budget of `--budget` x the offline hidden states (default
  0.25); its wall time (the first start to the last end) and the peak size of the hidden-state
  directory, sampled every 20 ms while it runs.

Printed: each figure, streaming ÷ max(extract, train) (target ≤ 1.15 at one epoch: the
overlap hides the shorter stage), and peak disk ÷ offline disk. On a CPU-only host both halves
share the same cores (each rank's thread count is its share of them, workers/runtime/cpu_share.py),
so the overlap there can only hide waiting, not compute: the ratio measures eyas's overhead
plus the contention, not what separate GPUs give. Run: python tests/bench/bench_stream.py
[--epochs 1] [--ranks 1] [--budget 0.25]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "support"))

from daemon_harness import Daemon, short_tmp  # noqa: E402
from stream_world import DiskSampler, hs_bytes  # noqa: E402

CACHE = Path(tempfile.gettempdir()) / "eyas-bench-stream-v1"
TARGET_RATIO = 1.15


def toml(assets: dict, name: str, epochs: int, ranks: int, storage: dict | None) -> str:
    text = (REPO / "workers" / "examples" / "demo.toml").read_text()
    text = text.replace('"assets/tiny-deepseek"', json.dumps(str(assets["tiny-deepseek"])))
    text = text.replace('"assets/chat.jsonl"', json.dumps(str(assets["chat.jsonl"])))
    text = text.replace('name = "demo"', f'name = "{name}"\npreflight = false')
    text = text.replace(', "evaluate"]', "]")
    text = re.sub(r"^\[evaluate\].*?(?=^\[stages)", "", text, flags=re.M | re.S)
    text = re.sub(r"^epochs = \d+", f"epochs = {epochs}", text, flags=re.M)
    text = re.sub(r"^ranks = \d+", f"ranks = {ranks}", text, flags=re.M)
    if storage:
        text += "\n[storage]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in storage.items())
    return text


def run(daemon: Daemon, text: str, name: str) -> tuple[dict, int]:
    """(the run, the peak size of its hidden states while it ran)."""
    run_id = daemon.submit(text, f"{name}.toml")
    sampler = DiskSampler(Path(daemon.run(run_id)["output_dir"]) / "extract")
    r = daemon.wait_run(run_id, timeout=3600)
    peak = sampler.stop()
    if r["state"] != "succeeded":
        raise SystemExit(f"{name}: run {run_id} {r['state']}: {r['reason']}\n{daemon.diagnose(run_id)}")
    return r, peak


def times(r: dict) -> dict[str, tuple[float, float]]:
    """(start, end) of each stage's last attempt."""
    return {
        s["name"]: (s["attempt_list"][-1]["started_at"], s["attempt_list"][-1]["ended_at"])
        for s in r["stages"]
        if s["name"] in ("extract", "train")
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--budget", type=float, default=0.25, help="the window's budget, a fraction of offline's disk")
    args = ap.parse_args()

    from eyas.cli.demo import FIT_STEPS
    from eyas.workers.models import assets as build

    made = build.build_all(CACHE / "assets", fit_steps=FIT_STEPS)
    home = short_tmp()
    os.environ.update(EYAS_HOME=str(home), XDG_RUNTIME_DIR=str(home / "rt"))
    daemon = Daemon(home).start()
    try:
        off, off_peak = run(daemon, toml(made, "offline", args.epochs, args.ranks, None), "offline")
        offline_disk = hs_bytes(Path(off["output_dir"]) / "extract")
        budget = offline_disk * args.budget
        storage = {"mode": "streaming", "budget_gb": budget / 1e9}
        on, on_peak = run(daemon, toml(made, "streaming", args.epochs, args.ranks, storage), "streaming")
    finally:
        daemon.cleanup()
        shutil.rmtree(home, ignore_errors=True)

    t_off, t_on = times(off), times(on)
    extract_s = t_off["extract"][1] - t_off["extract"][0]
    train_s = t_off["train"][1] - t_off["train"][0]
    offline_s = t_off["train"][1] - t_off["extract"][0]
    streaming_s = max(e for _, e in t_on.values()) - min(s for s, _ in t_on.values())
    ex = next(s for s in on["stages"] if s["name"] == "extract")["summary"]
    tr = next(s for s in on["stages"] if s["name"] == "train")["summary"]
    ratio = streaming_s / max(extract_s, train_s)
    figures = {
        "epochs": args.epochs,
        "ranks": args.ranks,
        "cpus": len(os.sched_getaffinity(0)),
        "offline_wall_s": round(offline_s, 1),
        "offline_extract_s": round(extract_s, 1),
        "offline_train_s": round(train_s, 1),
        "streaming_wall_s": round(streaming_s, 1),
        "streaming_over_max_stage": round(ratio, 3),
        "offline_disk_mb": round(offline_disk / 1e6, 2),
        "budget_mb": round(budget / 1e6, 2),
        "streaming_peak_disk_mb": round(on_peak / 1e6, 2),
        "peak_disk_over_offline": round(on_peak / offline_disk, 3),
        "mode": ex["streaming"],
        "extract_waits_on_window": ex["extract_waits"],
        "extract_wait_s": ex["extract_wait_s"],
        "train_waits_on_extract": int(tr["train_waits"]),
        "train_wait_s": round(tr["train_wait_s"], 1),
        "val_loss_offline": off_val if (off_val := _val(off)) is not None else None,
        "val_loss_streaming": _val(on),
    }
    print(json.dumps(figures, indent=1))
    verdict = "meets" if ratio <= TARGET_RATIO else "misses"
    print(f"streaming ÷ max(extract, train) = {ratio:.3f}: {verdict} the {TARGET_RATIO} target")
    if on_peak > budget:
        print(f"FAIL: the hidden states reached {on_peak} bytes, over the {int(budget)}-byte budget")
        return 1
    return 0


def _val(r: dict) -> float | None:
    return next(s for s in r["stages"] if s["name"] == "train")["summary"].get("val_loss")


if __name__ == "__main__":
    sys.exit(main())
