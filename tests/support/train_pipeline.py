"""Helpers for the training tests: real stage inputs built in-process, and vLLM in a subprocess.

`build_inputs` runs the real prepare, extract and vocab stages (one rank, in this process) on
a tiny target and a small synthetic chat set, so that the train stage reads exactly what a
pipeline run gives it. `vllm_generate` loads a target with an EAGLE-3 draft into vLLM's CPU
build in a child process (this file, run as a script: vLLM wants the __main__ guard) and
returns what it generated and its speculative-decoding counters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from runtoml import run_toml

REPO = Path(__file__).resolve().parents[2]


def config(
    root: Path,
    target: Path,
    data: Path,
    rows: int = 40,
    draft_vocab: int = 256,
    validation_fraction: float = 0.2,
    **train,
) -> dict:
    """The run config, checked and resolved by eyas' own loader (defaults filled in)."""
    from eyas.state.runconfig import load

    # Sized to keep the stages quick on two loaded cores: ~40 rows of ~70 tokens.
    text = run_toml(
        "train-test",
        ["prepare", "extract", "vocab", "train"],
        target={"path": target, "dtype": "float32"},
        data={"path": data, "max_length": 128, "limit": rows, "validation_fraction": validation_fraction},
        extract={"batch_size": 8},
        resources={"ranks": 1, "devices": "cpu"},
        draft={"vocab_size": draft_vocab, "ttt_steps": 3},
        train={"epochs": 2, "lr": 1e-3, "batch_tokens": 512, "seed": 0},
    )
    path = root / f"run-{time.monotonic_ns()}.toml"
    path.write_text(text)
    cfg = load(path).to_dict()
    cfg["train"].update(train)
    return cfg


def context(
    stage: str, out: Path, cfg: dict, rank: int = 0, world_size: int = 1, attempt: int = 1, options: dict | None = None
):
    from rank_context import rank_context

    attempt_dir = out.parent / "attempts" / f"{out.name}-{stage}-{attempt}-{time.monotonic_ns()}"
    attempt_dir.mkdir(parents=True)
    if options is not None:
        cfg = json.loads(json.dumps(cfg))
        cfg.setdefault("stages", {})[stage] = {"options": options}
    return rank_context(
        stage,
        attempt_dir,
        out,
        cfg,
        rank=rank,
        world_size=world_size,
        attempt=attempt,
        options=options,
        progress_interval=0,
    )


def run_stage(module, stage: str, out: Path, cfg: dict, **kw):
    ctx = context(stage, out, cfg, **kw)
    try:
        module.main(ctx)
    finally:
        ctx.progress.close()
    return ctx


def build_inputs(root: Path, family: str = "deepseek_v3", rows: int = 40, **kw) -> tuple[Path, dict]:
    """A tiny target, chats, and the prepare/extract/vocab outputs under root/base; (out, cfg).
    `kw`: config()'s draft_vocab and validation_fraction."""
    from eyas.workers.models import assets
    from eyas.workers.stages import extract, prepare, vocab

    target = assets.build_model(root / f"tiny-{family}", family)
    data = assets.write_dataset(root / "chat.jsonl", n=rows + 10)
    cfg = config(root, target, data, rows=rows, **kw)
    out = root / "base"
    for name, module in (("prepare", prepare), ("extract", extract), ("vocab", vocab)):
        run_stage(module, name, out, cfg)
    return out, cfg


def copy_inputs(base: Path, dest: Path) -> Path:
    """A fresh output dir holding base's prepare/extract/vocab outputs, but no train/."""
    import shutil

    for stage in ("prepare", "extract", "vocab"):
        shutil.copytree(base / stage, dest / stage)
    return dest


def summary(ctx) -> dict:
    return json.loads((ctx.attempt_dir / "summary.json").read_text())


def progress_records(ctx) -> list[dict]:
    """The counting lines; heartbeats (model build, checkpoints) are left out."""
    lines = [json.loads(line) for line in (ctx.attempt_dir / "rank-0.progress.jsonl").read_text().splitlines()]
    return [r for r in lines if "heartbeat" not in r]


# --- vLLM ----------------------------------------------------------------------------------

PROMPTS = ["<|bos|><|user|>Count to ten<|end|><|assistant|>", "<|bos|><|user|>The quick red fox<|end|><|assistant|>"]


def vllm_generate(target: Path, draft: Path, timeout: float = 420) -> tuple[int, dict | None, str]:
    """(exit code, {"texts", "token_ids", "metrics"} or None, the child's output)."""
    from eyas.workers.vllm.settings import speculative_env

    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONUNBUFFERED": "1",
        **speculative_env(target, on_gpu=False),
    }
    p = subprocess.run(
        [sys.executable, __file__, "vllm", str(target), str(draft)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=str(REPO),
    )
    out = p.stdout + p.stderr
    result = None
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    return p.returncode, result, out


def _vllm_main(target: str, draft: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=target,
        speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 3},
        enforce_eager=True,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=2,
        disable_log_stats=False,
    )
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode") and hasattr(m, "value"):
            metrics[m.name] = m.value
    print(
        "RESULT "
        + json.dumps(
            {
                "texts": [o.outputs[0].text for o in outs],
                "token_ids": [list(o.outputs[0].token_ids) for o in outs],
                "metrics": metrics,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["vllm"]:
        _vllm_main(sys.argv[2], sys.argv[3])
