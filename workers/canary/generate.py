"""The regenerate stage's canary: its own generation path (workers/vllm/generate.py: the engine, the worker extension, the TP size, the engine options, the sampling) answering a few of the run's prompts on a shrunken, dummy-weight copy of the target, and the answers checked.

The same swap as the extraction's canary (canary/run.py): the target's config.json cut down
(canary/shrink.py) beside its other files, vLLM's `load_format = "dummy"`. A bug on the path (a
worker that cannot load the model class, an engine option vLLM refuses, a TP size the engine
cannot shard) raises here, in the same worker and with the same traceback, seconds into the
preflight rather than after the target has loaded. Dummy weights answer nonsense, so only the
form of the answers is checked: between one token and the budget, every id inside the target's
vocabulary, vLLM's finish reason "stop" only after a stop token.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from eyas.state.runconfig import RunConfig
from eyas.state.target import default_layer_ids, read_model_config, text_value
from eyas.workers.canary import samples
from eyas.workers.canary.run import CanaryFailed, build_target, engine_start, worker_records
from eyas.workers.canary.shrink import shrink

log = logging.getLogger("eyas.canary")

PROMPTS = 3
PROMPT_TOKENS = 24  # the head of each sample row: a prompt of the run's own tokens
MAX_TOKENS = 8


def wanted(cfg: RunConfig) -> bool:
    return "regenerate" in cfg.pipeline and cfg.regenerate.canary


def run(cfg: RunConfig, output_dir: Path, workdir: Path, progress=None) -> dict[str, Any]:
    """Generate a few answers on the shrunken target in `workdir` (emptied first, removed
    after); returns the report. Raises what the path raised, or CanaryFailed on a wrong answer."""
    from eyas.workers.regenerate.settings import Settings
    from eyas.workers.vllm import generate

    t0 = time.monotonic()
    shutil.rmtree(workdir, ignore_errors=True)
    stage = cfg.stages.get("regenerate")
    settings = Settings.from_config(cfg.to_dict(), stage.options if stage else {}, output_dir)
    model_cfg = read_model_config(settings.target_path)
    n = text_value(model_cfg, "num_hidden_layers")
    shrunk = shrink(model_cfg, default_layer_ids(n))
    target_dir = build_target(settings.target_path, shrunk.config, workdir / "target")
    vocab = int(text_value(shrunk.config, "vocab_size"))
    rows, source = samples.take(cfg, output_dir, PROMPTS)
    prompts = [row[: min(PROMPT_TOKENS, max(1, settings.context - MAX_TOKENS))] for row in rows]
    budget = max(1, min(MAX_TOKENS, settings.context - max(len(p) for p in prompts)))
    log.info(
        "canary: regenerate's generation at TP %d, dummy weights, %d of %d layers; %d prompts of %s tokens from %s",
        settings.tensor_parallel_size,
        shrunk.canary_layers,
        shrunk.num_layers,
        len(prompts),
        [len(p) for p in prompts],
        source,
    )
    with worker_records(workdir):
        with engine_start(progress):
            engine = generate.launch(
                target_path=str(target_dir),
                dtype=settings.dtype,
                tp=settings.tensor_parallel_size,
                trust_remote_code=settings.trust_remote_code,
                max_model_len=settings.context,
                options={**settings.vllm_options, "load_format": "dummy"},
                model_cfg=shrunk.config,
            )
        try:
            requests = [generate.Request(f"canary-{i}", tuple(p), budget, seed=i) for i, p in enumerate(prompts)]
            outs = generate.generate(
                engine,
                requests,
                temperature=settings.temperature,
                top_p=settings.top_p,
                stop_token_ids=settings.stop_token_ids,
            )
        finally:
            engine.shutdown()
    check(outs, budget, vocab, set(settings.stop_token_ids))
    shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "tensor_parallel_size": settings.tensor_parallel_size,
        "vllm": engine.version,
        **shrunk.as_json(),
        "prompts": len(prompts),
        "max_tokens": budget,
        "answers": [{"tokens": len(o.tokens), "finish": o.finish} for o in outs],
        "data": source,
        "seconds": round(time.monotonic() - t0, 2),
    }
    log.info("canary passed in %.1f s: %s", report["seconds"], report["answers"])
    return report


def check(outs, budget: int, vocab: int, stop_ids: set[int]) -> None:
    """The form of each answer (see the module docstring); CanaryFailed names the first wrong one."""
    for i, out in enumerate(outs):
        if not 1 <= len(out.tokens) <= budget:
            raise CanaryFailed(f"answer {i}: {len(out.tokens)} tokens, for a budget of {budget}")
        bad = [t for t in out.tokens if not 0 <= t < vocab]
        if bad:
            raise CanaryFailed(f"answer {i}: token id {bad[0]} is outside the target's vocabulary of {vocab}")
        if out.finish == "stop" and stop_ids and out.tokens[-1] not in stop_ids:
            raise CanaryFailed(
                f"answer {i}: vLLM says it stopped, but its last token {out.tokens[-1]} is no stop token "
                f"{sorted(stop_ids)}: the answers' ends would be misread"
            )
