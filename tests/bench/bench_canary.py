"""The extraction canary against the full engine load it saves: how soon each reaches the first captured batch.

Each measurement is a fresh process, timed from its start to its exit, imports included, as a
rank pays them:
- full: the extract stage's vLLM path on the target itself (Engine.start with its real
  weights at the run's TP size, then the first batch of the plan, then shutdown): where a
  broken worker extension fails today;
- canary: workers/canary/run.py on the same run config (the shrunken copy, dummy weights,
  two batches of the run's data, the captures checked).
The figure is canary ÷ full, per target. The tiny DeepseekV3 (the seed's classes, 8 layers, a
few MB) at TP 2 shows the floor: there the load is all start-up, which the canary pays too.
A mid-size Llama (1.4 GB of float32 weights, 12 layers) at TP 1 shows where loading weights
starts to count; on a real target (the seed's 18-minute load) that term is the whole cost.
The runs alternate (full, canary, canary, full) and the best of each counts.

Run: python tests/bench/bench_canary.py [--runs 2] [--tiny-only]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CACHE = Path(tempfile.gettempdir()) / "eyas-bench-canary-v1"
LENGTHS = [44, 9, 71, 26, 58, 13, 35, 80, 19, 50]


def build(kind: str) -> tuple[Path, Path]:
    """(target, output dir holding a prepared dataset), built once and kept for reruns."""
    from eyas.workers.models import assets

    root = CACHE / kind
    target = root / "target"
    if not (target / "model.safetensors").exists() and not (target / "model.safetensors.index.json").exists():
        spec = None
        if kind == "mid":
            spec = assets.TinySpec("llama", hidden_size=1536, num_hidden_layers=12, intermediate_size=4096)
        assets.build_model(target, "deepseek_v3" if kind == "tiny" else "llama", spec=spec)
    out = root / "out"
    if not (out / "prepare" / "dataset").exists():
        import datasets
        import torch

        vocab = json.loads((target / "config.json").read_text())["vocab_size"]
        g = torch.Generator().manual_seed(4)
        rows = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]
        datasets.Dataset.from_dict(
            {"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows], "seq_len": [len(r) for r in rows]}
        ).save_to_disk(str(out / "prepare" / "dataset"))
    return target, out


def run_config(target: Path, out: Path, tp: int) -> dict:
    return {
        "name": "bench-canary",
        "pipeline": ["extract"],
        "output_dir": str(out),
        "target": {"path": str(target), "dtype": "float32"},
        "extract": {"backend": "vllm", "tensor_parallel_size": tp, "batch_size": 4},
        "resources": {"devices": "cpu"},
    }


def child(mode: str, cfg_path: Path, scratch: Path) -> None:
    from eyas.state.runconfig import RunConfig

    cfg = RunConfig.model_validate(json.loads(cfg_path.read_text()))
    out = Path(cfg.output_dir)
    if mode == "canary":
        from eyas.workers.canary import run as canary

        report = canary.run(cfg, out, scratch / "canary")
        print("RESULT", json.dumps({"samples": report["samples"], "layers": report["layers"]}), flush=True)
        return
    from eyas.state.target import default_layer_ids, read_model_config
    from eyas.workers.extract import plan as extract_plan
    from eyas.workers.vllm import backend
    from eyas.workers.vllm.engine import Engine

    ds = extract_plan.load_dataset(out / "prepare" / "dataset")
    lengths = extract_plan.row_lengths(ds, out)
    model_cfg = read_model_config(cfg.target.path)
    n = model_cfg["num_hidden_layers"]
    engine = Engine.start(
        target_path=cfg.target.path,
        architecture=model_cfg["architectures"][0],
        dtype="float32",
        tp=cfg.extract.tensor_parallel_size,
        trust_remote_code=False,
        layer_ids=default_layer_ids(n),
        hs_dir=scratch / "hs",
        max_len=max(lengths),
        model_cfg=model_cfg,
    )
    try:
        first = extract_plan.plan_batches(lengths, 1, 0, cfg.extract.batch_size)[:1]
        backend.run(engine, ds, lengths, first, scratch / "hs")
    finally:
        engine.shutdown()
    print("RESULT", json.dumps({"samples": len(first[0]), "layers": [n, n]}), flush=True)


def measure(mode: str, cfg: dict) -> float:
    with tempfile.TemporaryDirectory(prefix="eyas-bench-canary-") as tmp:
        cfg_path = Path(tmp) / "cfg.json"
        cfg_path.write_text(json.dumps(cfg))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, __file__, "--child", mode, str(cfg_path), tmp],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        seconds = time.monotonic() - t0
    if proc.returncode != 0 or "RESULT" not in proc.stdout:
        sys.exit(f"{mode} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--tiny-only", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "CONFIG", "SCRATCH"))
    args = parser.parse_args()
    if args.child:
        mode, cfg, scratch = args.child
        child(mode, Path(cfg), Path(scratch))
        return
    cases = [("tiny", 2)] + ([] if args.tiny_only else [("mid", 1)])
    print(f"{'target':<8} {'TP':>2} {'full (s)':>9} {'canary (s)':>10} {'canary / full':>14}")
    for kind, tp in cases:
        target, out = build(kind)
        cfg = run_config(target, out, tp)
        times: dict[str, list[float]] = {"full": [], "canary": []}
        for r in range(args.runs):
            for mode in ("full", "canary") if r % 2 == 0 else ("canary", "full"):
                times[mode].append(measure(mode, cfg))
        full, can = min(times["full"]), min(times["canary"])
        print(f"{kind:<8} {tp:>2} {full:>9.1f} {can:>10.1f} {can / full:>14.3f}", flush=True)
        print(
            f"         all runs: full {[round(t, 1) for t in times['full']]}, canary {[round(t, 1) for t in times['canary']]}"
        )


if __name__ == "__main__":
    main()
