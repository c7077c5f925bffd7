"""The evaluate stage's engine layout on vLLM's CPU build: one process per engine vs vLLM's default.

Each evaluate measurement is a child process with one vLLM engine (workers/evaluate/engines.py). By
default vLLM starts an EngineCore process from it and, on the CPU build, a worker process
from that: three processes that each import vLLM. eyas sets VLLM_ENABLE_V1_MULTIPROCESSING=0
on the CPU build (workers/vllm/settings.py: in_process_engine_env), so the engine runs in the
child itself. This bench runs the same measurement (the tiny DeepseekV3 of
eyas.workers.models.assets alone, 30 prompts × 64 greedy tokens, the stage's own engine arguments)
both ways, alternating, and prints:

- wall time of the whole measurement (process start to result), default / eyas: the target
  is > 1 (the demo's evaluate stage loads three such engines);
- tok/s of the timed run, eyas / default: the target is >= 0.9 (the engine must not get
  slower once it is in one process);
- whether the greedy outputs are identical (they must be).

The best of --runs counts for each side (load from others on a shared machine only slows a
run down); every run is printed.

Run: python tests/bench/bench_evaluate.py [--runs 2]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

CACHE = Path(tempfile.gettempdir()) / "eyas-bench-evaluate-v1"


def spec(target: Path):
    from eyas.workers.evaluate.engines import Spec

    rng = random.Random(0)
    prompts = [[rng.randrange(8, 500) for _ in range(rng.randint(16, 48))] for _ in range(30)]
    return Spec(
        label="target",
        target=str(target),
        draft=None,
        num_speculative_tokens=3,
        dtype="float32",
        tensor_parallel_size=1,
        trust_remote_code=False,
        prompts=prompts,
        max_tokens=64,
        max_num_seqs=16,
        enforce_eager=True,
        cpu_mla=True,
    )


def stage_env(target: Path) -> dict[str, str]:
    """The evaluate stage's own engine environment on the CPU build (TP 1)."""
    from eyas.workers.stages.evaluate import engine_env

    # engine_env reads only the target and the TP size of the stage's settings.
    return engine_env(SimpleNamespace(target=str(target), tp=1), cpu_build=True)


def run_once(s, work: Path, env: dict[str, str]) -> dict:
    from eyas.workers.evaluate.engines import measure

    t0 = time.monotonic()
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(1)
    os.dup2(devnull, 1)  # the child's vLLM log passes through our stdout: keep the figures readable
    try:
        res = measure(s, work, env, timeout=600)
    finally:
        os.dup2(saved, 1)
        os.close(devnull)
        os.close(saved)
    res["wall"] = time.monotonic() - t0
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    from eyas.workers.models import assets

    target = CACHE / "tiny-deepseek"
    if not (target / assets.MARKER).exists():
        assets.build_all(CACHE)
    s = spec(target)
    eyas_env = stage_env(target)
    # The one difference: vLLM's default layout, an EngineCore and a worker process per engine.
    envs = {"default": {**eyas_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "eyas": eyas_env}
    print(f"the stage's environment: {eyas_env}")
    sides = {"default": [], "eyas": []}
    for i in range(args.runs):
        for side, env in envs.items():
            res = run_once(s, CACHE / "work" / side, env)
            sides[side].append(res)
            print(
                f"run {i + 1} {side:8s}: whole measurement {res['wall']:6.1f} s, engine up {res['load_seconds']:5.1f} s, "
                f"timed run {res['tok_s']:7.1f} tok/s",
                flush=True,
            )
    best = {side: min(r["wall"] for r in runs) for side, runs in sides.items()}
    tok_s = {side: max(r["tok_s"] for r in runs) for side, runs in sides.items()}
    same = all(r["token_ids"] == sides["default"][0]["token_ids"] for runs in sides.values() for r in runs)
    print(
        f"whole measurement, best: default {best['default']:.1f} s, eyas {best['eyas']:.1f} s: "
        f"ratio default/eyas = {best['default'] / best['eyas']:.2f} (target > 1)"
    )
    print(
        f"timed run, best: eyas {tok_s['eyas']:.1f} tok/s, default {tok_s['default']:.1f} tok/s: "
        f"ratio eyas/default = {tok_s['eyas'] / tok_s['default']:.2f} (target >= 0.9)"
    )
    print(f"greedy outputs identical in every run: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
