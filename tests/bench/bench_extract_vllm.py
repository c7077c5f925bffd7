"""Extraction on the vllm backend (vLLM's CPU build): throughput against prefill-only generate.

The tiny DeepseekV3 target (MLA + MoE, eyas.workers.models.assets) at TP=1, then TP=2; every
measurement runs the same prompts in the same batches (extract_plan.plan_batches), in one engine
per tensor-parallel size (an engine takes 20-50 s to start here):

- generate: `LLM.generate(batch, max_tokens=1)` per batch, no capture (the floor);
- eyas: the stage's own loop (vllm_backend.run): the workers' hooks at the run's layer ids,
  the layout check of every step, TP rank 0's background writer, atomic files;
  eyas_finish then takes the hooks off again, so the next generate runs unobserved.
Target at TP=1: eyas tok/s >= 0.85 x generate. The order is symmetric (generate, eyas, eyas,
generate) and the best of each counts: other load on a shared machine only ever slows a
measurement down. `generate, one call` (every prompt in one generate call) is printed as
vLLM's best case, for scale.

Run: python tests/bench/bench_extract_vllm.py [--samples 64 --seq 512 --batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_RATIO = 0.85
LAYER_IDS = (2, 4, 5, 8)  # config.default_layer_ids(8)
CACHE = Path(tempfile.gettempdir()) / "eyas-bench-extract-vllm-v1"


def build(root: Path, samples: int, seq: int) -> tuple[Path, Path]:
    """The tiny DeepseekV3 and a dataset of `samples` random `seq`-token prompts (kept for reruns)."""
    target = root / "deepseek_v3"
    if not (target / "model.safetensors").exists():
        from eyas.workers.models import assets

        assets.build_model(target, "deepseek_v3")
        cfg = json.loads((target / "config.json").read_text())
        cfg["scoring_func"] = "sigmoid"  # DeepSeek-V3's routing, as transformers runs it
        (target / "config.json").write_text(json.dumps(cfg, indent=2))
    data = root / f"data-{samples}x{seq}"
    if not data.exists():
        import datasets
        import torch

        vocab = json.loads((target / "config.json").read_text())["vocab_size"]
        rows = torch.randint(8, vocab, (samples, seq), generator=torch.Generator().manual_seed(1)).tolist()
        datasets.Dataset.from_dict(
            {"input_ids": rows, "loss_mask": [[1] * seq] * samples, "seq_len": [seq] * samples}
        ).save_to_disk(str(data))
    return target, data


def child(tp: int, target: Path, data: Path, batch: int, scratch: Path) -> dict:
    """All measurements of one tensor-parallel size, in this (fresh) process and one engine."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eyas.state.target import read_model_config
    from eyas.workers.extract import hswriter
    from eyas.workers.extract import plan as extract_plan
    from eyas.workers.vllm import backend as vllm_backend
    from eyas.workers.vllm.engine import Engine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ds = extract_plan.load_dataset(data)
    lengths = extract_plan.row_lengths(ds, data)
    plan = extract_plan.plan_batches(lengths, 1, 0, batch)
    rows = ds.with_format(None)
    prompts = [[TokensPrompt(prompt_token_ids=list(rows[i]["input_ids"])) for i in b] for b in plan]
    model_cfg = read_model_config(target)
    engine = Engine.launch(
        target_path=str(target),
        dtype="float32",
        tp=tp,
        trust_remote_code=False,
        max_len=max(lengths),
        model_cfg=model_cfg,
        options={"max_num_batched_tokens": batch * max(lengths), "max_num_seqs": batch},
    )
    params = SamplingParams(max_tokens=1, detokenize=False)
    tokens = sum(lengths)

    def generate() -> float:
        t0 = time.perf_counter()
        for p in prompts:
            engine.llm.generate(p, params, use_tqdm=False)
        return tokens / (time.perf_counter() - t0)

    def generate_once() -> float:
        t0 = time.perf_counter()
        engine.llm.generate([p for b in prompts for p in b], params, use_tqdm=False)
        return tokens / (time.perf_counter() - t0)

    def eyas(n: int) -> float:
        hs_dir = scratch / f"hs-{tp}-{n}"
        engine.attach(model_cfg["architectures"][0], LAYER_IDS, "float32", hs_dir)
        t0 = time.perf_counter()
        stats, _ = vllm_backend.run(engine, ds, lengths, plan, hs_dir)
        rate = tokens / (time.perf_counter() - t0)
        assert stats.written == len(lengths) == len(hswriter.existing(hs_dir)), stats
        shutil.rmtree(hs_dir)
        return rate

    generate()  # warm-up: first-step allocations and kernel setup, off the clock
    runs = {"generate": [generate()], "eyas": [eyas(1), eyas(2)]}
    runs["generate"].append(generate())
    once = generate_once()
    engine.shutdown()
    return {"tp": tp, "tokens": tokens, "generate": runs["generate"], "eyas": runs["eyas"], "generate_once": once}


def measure(tp: int, target: Path, data: Path, batch: int, scratch: Path) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            str(tp),
            "--target",
            str(target),
            "--data",
            str(data),
            "--batch",
            str(batch),
            "--scratch",
            str(scratch),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    if proc.returncode != 0:
        raise SystemExit(f"TP={tp} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    gen, ours = max(result["generate"]), max(result["eyas"])
    result["ratio"] = ours / gen
    print(
        f"  TP={tp}: generate {gen:8.0f} tok/s  eyas {ours:8.0f} tok/s  ratio {result['ratio']:.3f}   "
        f"(runs: generate {', '.join(f'{r:.0f}' for r in result['generate'])}; "
        f"eyas {', '.join(f'{r:.0f}' for r in result['eyas'])}; generate, one call {result['generate_once']:.0f})",
        flush=True,
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq", type=int, default=512, help="tokens per prompt")
    parser.add_argument("--batch", type=int, default=16, help="extract.batch_size")
    parser.add_argument("--tp", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, Path(args.target), Path(args.data), args.batch, Path(args.scratch))))
        return 0

    CACHE.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    target, data = build(CACHE, args.samples, args.seq)
    print(
        f"target: tiny DeepseekV3 (hidden 64, 8 layers, MLA + MoE), fp32, vLLM CPU build, {os.cpu_count()} CPUs; "
        f"{args.samples} prompts x {args.seq} tokens, batches of {args.batch}; layer ids {list(LAYER_IDS)}",
        flush=True,
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="eyas-bench-vllm-") as scratch:
        for tp in args.tp:
            results[tp] = measure(tp, target, data, args.batch, Path(scratch))
    ok = True
    if 1 in results:
        ratio = results[1]["ratio"]
        ok = ratio >= TARGET_RATIO
        print(
            f"throughput at TP=1: eyas / prefill-only generate = {ratio:.3f} "
            f"(target >= {TARGET_RATIO:.2f}: {'met' if ok else 'MISSED'})"
        )
    if 2 in results:
        print(
            f"throughput at TP=2: eyas / prefill-only generate = {results[2]['ratio']:.3f} "
            "(two workers on two cores: a figure, not a target)"
        )
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
