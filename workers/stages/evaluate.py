"""The `evaluate` stage: how much faster the trained draft makes the target in vLLM.

Three measurements, one vLLM engine each, each in a child process (workers/evaluate/engines.py says
why); loaded at once on vLLM's CPU build (one at a time on GPUs), and timed one after another,
each while no other engine works, so that their throughputs compare:
1. the target alone: the reference greedy outputs, and tok/s without a draft;
2. the target with the trained draft as its EAGLE-3 speculator (train/checkpoints/best):
   acceptance and tok/s with the draft;
3. the target with the untrained baseline: the same draft before training (evaluate/drafts.py), so
   that every result stands beside what the draft's shape alone gives.
Each generates greedily (temperature 0, up to evaluate.max_tokens) for the same held-out
prompts (evaluate/prompts.py). Speculative decoding must be lossless: for every prompt, the token
ids with either draft must equal the target's own. A mismatch fails the stage, naming the
first prompt and position that differ (after the figures are recorded).

Error bars: vLLM counts drafts and accepted tokens per request (evaluate/engines.py says how,
and why that costs the timed runs nothing), so each figure comes with a 95 % percentile
bootstrap interval over prompts (evaluate/bootstrap.py: 2000 draws, seed 0, the same interval
in every run; a held-out chat's turns are resampled together): the acceptance length and
per-position rates of either draft, and the gain (trained - untrained acceptance length),
paired, from the same draws.

The quality gate: a trained draft whose gain is below evaluate.min_gain (0: off) fails the
stage with QualityGateFailed, in words (what it accepted, against what, on how many prompts,
the gain and its interval), after the figures are recorded, like a mismatch. The failure is
final: the same draft on the same prompts gives the same figures (greedy, fixed seeds), so the
daemon does not restart it whatever max_restarts says (the exception's `eyas_final`, carried by
the rank's error record: daemon/settle.py).

Engine settings (the code path is the same on CPU and GPU; only these differ):
- tensor_parallel_size: evaluate.tensor_parallel_size, by default the run's
  (extract.tensor_parallel_size); the rank must see that many GPUs;
- dtype: target.dtype; enforce_eager on vLLM's CPU build only (GPUs keep CUDA graphs, which
  is how the draft will serve);
- on the CPU build: VLLM_CPU_KVCACHE_SPACE=1 (GiB, unless set), VLLM_MLA_DISABLE=1 for MLA
  targets, the engine core in the engine's own child process (VLLM_ENABLE_V1_MULTIPROCESSING=0:
  one process per engine instead of three; workers/vllm/settings.py says why), the CPU TP core
  binding (vllm/engine.py: cpu_env);
- the same environment and arguments for all three engines, the reference included, so the
  target computes the same function in each.
Extra engine arguments: [stages.evaluate] options = { vllm = { gpu_memory_utilization = 0.8 } }.

Outputs: <output_dir>/evaluate/results.json (the figures, plus every prompt and each engine's
output token ids), <output_dir>/evaluate/baseline-draft/ (the untrained draft), summary.json
in the attempt dir (stored in SQLite by the daemon), and progress lines whose figures land in
the metrics table: target_tok_s, draft_tok_s, baseline_tok_s, accept_len, accept_len_lo,
accept_len_hi, accept_rate, accept_pos_<i>, baseline_accept_len (and _lo, _hi),
baseline_accept_rate, baseline_accept_pos_<i>, gain, gain_lo, gain_hi, prompts, answer_tokens,
speedup, mismatched_prompts and lossless (1 or 0).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.state import contract
from eyas.workers.evaluate import bootstrap
from eyas.workers.evaluate import report as eval_report
from eyas.workers.evaluate.engines import Spec, measure_all
from eyas.workers.runtime import atomic

log = logging.getLogger("eyas.evaluate")

RESULTS = "results.json"
BASELINE_DIR = "baseline-draft"


class LosslessError(RuntimeError):
    """A draft changed the target's greedy output."""


class QualityGateFailed(RuntimeError):
    """The trained draft gains less acceptance length over the untrained one than
    evaluate.min_gain. Final: a rerun measures the same (the daemon does not restart it)."""

    eyas_final = True


@dataclass(frozen=True)
class Settings:
    target: str
    dtype: str
    trust_remote_code: bool
    k: int
    max_tokens: int
    max_prompts: int
    prompts_file: str | None
    batch_size: int
    tp: int
    seed: int
    min_gain: float
    draft_vocab: int
    num_layers: int
    ttt_steps: int
    out: Path  # the run's output dir
    data: Path  # the run's dataset folder: prepare's, or regenerate's (state/regenerate.py: data_dir)
    engine_options: dict[str, Any]


def settings(ctx) -> Settings:
    from eyas.state.regenerate import data_dir
    from eyas.state.runconfig import RunConfig, stage_options

    cfg = RunConfig.from_dict(ctx.config)
    if cfg.target is None:
        raise ValueError("evaluate needs [target] in the run's config (the model the draft speeds up); add it")
    ev = cfg.evaluate
    return Settings(
        target=cfg.target.path,
        dtype=cfg.target.dtype,
        trust_remote_code=cfg.target.trust_remote_code,
        k=ev.num_speculative_tokens,
        max_tokens=ev.max_tokens,
        max_prompts=ev.max_prompts,
        prompts_file=ev.prompts,
        batch_size=ev.batch_size,
        tp=ev.tensor_parallel_size or cfg.extract.tensor_parallel_size,
        seed=cfg.train.seed,
        min_gain=ev.min_gain,
        draft_vocab=cfg.draft.vocab_size,
        num_layers=cfg.draft.num_layers,
        ttt_steps=cfg.draft.ttt_steps,
        out=ctx.output_dir,
        data=data_dir(ctx.output_dir, cfg.pipeline),
        # Checked when the run was submitted (state/specs.py: EvaluateOptions).
        engine_options=dict(stage_options("evaluate", ctx.options).vllm),
    )


def engine_env(s: Settings, cpu_build: bool) -> dict[str, str]:
    """The children's extra environment (the same for all three engines)."""
    from eyas.workers.vllm.engine import cpu_env
    from eyas.workers.vllm.settings import in_process_engine_env, speculative_env

    if not cpu_build:
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if visible and len(visible) < s.tp:
            raise ValueError(
                f"evaluate.tensor_parallel_size: {s.tp} needs {s.tp} GPUs, but this rank sees "
                f"{len(visible)} (CUDA_VISIBLE_DEVICES={','.join(visible)}); list {s.tp} devices in "
                "resources.devices or lower evaluate.tensor_parallel_size"
            )
        return speculative_env(s.target, on_gpu=True)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **in_process_engine_env(on_gpu=False), **cpu_env(s.tp)}
    env = {key: os.environ.get(key) or value for key, value in env.items()}  # the user's settings win
    env.update(speculative_env(s.target, on_gpu=False))
    return env


def load_prompts(s: Settings) -> tuple[list[list[int]], list[int] | None, str]:
    """(prompts, their validation rows or None, where they came from)."""
    from eyas.workers.data.target_vocab import target_vocab_size
    from eyas.workers.evaluate import prompts as eval_prompts

    if s.prompts_file:
        prompts = eval_prompts.from_file(
            Path(s.prompts_file), s.target, s.trust_remote_code, target_vocab_size(s.target), s.max_prompts
        )
        return prompts, None, s.prompts_file
    prompts, rows = eval_prompts.from_validation(s.data, s.max_prompts)
    return prompts, rows, "validation split"


def main(ctx) -> None:
    s = settings(ctx)
    from eyas.workers.evaluate import drafts as eval_drafts
    from eyas.workers.vllm import version as vllm_version
    from eyas.workers.vllm.settings import is_mla

    version = vllm_version.require("evaluate", 'leave "evaluate" out of the pipeline')
    cpu_build = vllm_version.is_cpu_build()
    env = engine_env(s, cpu_build)
    stage_dir = ctx.stage_dir
    trained = eval_drafts.trained_draft(s.out / "train")
    prompts, rows, source = load_prompts(s)
    n = len(prompts)
    log.info(
        "evaluate: %d prompts from the %s (%d tokens at most, %d new tokens each), k = %d, vLLM %s (%s, "
        "tensor_parallel_size %d); trained draft %s",
        n,
        source,
        max(len(p) for p in prompts),
        s.max_tokens,
        s.k,
        version,
        "CPU build" if cpu_build else "GPU",
        s.tp,
        trained,
    )
    progress = ctx.progress
    # Samples (prompts measured) only, no tokens: the daemon's tok/s of a stage is its tokens over
    # wall time, which here would mostly be engine start-up; the stage's own tok/s figures
    # (target_tok_s, draft_tok_s, baseline_tok_s) are the timed runs'.
    progress.update(samples=0, samples_total=3 * n, force=True)
    baseline = eval_drafts.build_baseline(
        trained,
        stage_dir / BASELINE_DIR,
        target_path=s.target,
        extract_dir=s.out / "extract",
        vocab_dir=s.out / "vocab",
        draft_vocab=s.draft_vocab,
        num_layers=s.num_layers,
        ttt_steps=s.ttt_steps,
        seed=s.seed,
        trust_remote_code=s.trust_remote_code,
    )

    from eyas.state.target import read_model_config

    cpu_mla = cpu_build and is_mla(read_model_config(s.target))
    specs = [
        Spec(
            label=label,
            target=s.target,
            draft=str(draft) if draft else None,
            num_speculative_tokens=s.k,
            dtype=s.dtype,
            tensor_parallel_size=s.tp,
            trust_remote_code=s.trust_remote_code,
            prompts=prompts,
            max_tokens=s.max_tokens,
            max_num_seqs=min(s.batch_size, n),
            enforce_eager=cpu_build,
            cpu_mla=cpu_mla,
            engine_options=s.engine_options,
        )
        for label, draft in (("target", None), ("trained", trained), ("baseline", baseline))
    ]
    done = {"samples": 0}

    def measured(label: str, res: dict) -> None:
        done["samples"] += n
        log.info("evaluate: %s measured", "the target alone" if label == "target" else f"the {label} draft")
        progress.update(force=True, samples=done["samples"], **_metrics(label, res))

    # On the CPU build the three engines load at once (start-up dominates a tiny model's
    # measurement); on GPUs one at a time, since each takes most of the GPUs' memory.
    results = measure_all(
        specs, ctx.attempt_dir / "vllm", env, loads_at_once=3 if cpu_build else 1, on_result=measured, progress=progress
    )

    summary, failures = report(results, s, rows, source, trained, baseline, version, cpu_build)
    progress.update(force=True, **_summary_metrics(summary))
    atomic.write_json(
        stage_dir / RESULTS,
        {
            **summary,
            "prompt_token_ids": prompts,
            "rows": rows,
            "outputs_by_engine": {k: v["token_ids"] for k, v in results.items()},
            # Each prompt's drafts and accepted tokens (the bootstrap's data), per draft.
            "per_prompt_by_engine": {k: v.get("per_prompt") for k, v in results.items() if k != "target"},
        },
    )
    atomic.write_json(ctx.attempt_dir / contract.SUMMARY, summary)
    log.info(
        "evaluate: acceptance length %.3f %s with the trained draft, %.3f %s with the untrained baseline "
        "(gain %.3f %s; per position %s vs %s) on %d prompts, %d answer tokens; %.1f tok/s with the draft, "
        "%.1f without (x%.2f); lossless: %s",
        summary["acceptance_length"],
        _span(summary["acceptance_length_lo"], summary["acceptance_length_hi"]),
        summary["baseline_acceptance_length"],
        _span(summary["baseline_acceptance_length_lo"], summary["baseline_acceptance_length_hi"]),
        summary["gain"],
        _span(summary["gain_lo"], summary["gain_hi"]),
        _rates(summary["per_position"]),
        _rates(summary["baseline_per_position"]),
        summary["prompts"],
        summary["answer_tokens"],
        summary["draft_tok_s"],
        summary["target_tok_s"],
        summary["speedup"],
        "yes" if summary["lossless"] else "NO",
    )
    if failures:
        raise LosslessError(
            "speculative decoding changed the target's greedy output: "
            + "; ".join(failures)
            + f" (every output is in {stage_dir / RESULTS})"
        )
    verdict = gate(summary, s.min_gain)
    if verdict is not None:
        raise QualityGateFailed(verdict)


def _rates(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def _span(lo: float | None, hi: float | None) -> str:
    return f"[{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else "[no interval]"


def gate(summary: dict[str, Any], min_gain: float) -> str | None:
    """The quality gate's verdict: None when the trained draft gains at least `min_gain` in
    acceptance length over the untrained one (or the gate is off, `min_gain` 0), else the
    root cause in words."""
    if min_gain <= 0 or summary["gain"] >= min_gain:
        return None
    lo, hi = summary["gain_lo"], summary["gain_hi"]
    level = round(100 * summary["interval"]["level"])
    spread = (
        f"{level} % interval {lo:.2f} to {hi:.2f}" if lo is not None else "no interval: " + summary["interval"]["note"]
    )
    # "Nothing" when the gain could be none at all (its interval reaches 0); else "too little".
    what = "learned nothing" if lo is None or lo <= 0 or summary["gain"] <= 0 else "learned too little"
    return (
        f"the draft {what}: acceptance {summary['acceptance_length']:.2f} against "
        f"{summary['baseline_acceptance_length']:.2f} untrained on {summary['prompts']} prompts (gain "
        f"{summary['gain']:.2f}, {spread}; evaluate.min_gain = {min_gain:g}); train it longer or on more data, "
        "or lower evaluate.min_gain (0 turns the gate off)"
    )


def _summary_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The progress-line figures of the whole measurement (beside each engine's, _metrics)."""
    out = {
        "speedup": summary["speedup"],
        "mismatched_prompts": summary["mismatched_prompts"],
        "lossless": 1.0 if summary["lossless"] else 0.0,
        "gain": summary["gain"],
        "prompts": summary["prompts"],
        "answer_tokens": summary["answer_tokens"],
    }
    for key, name in (
        ("acceptance_length", "accept_len"),
        ("baseline_acceptance_length", "baseline_accept_len"),
        ("gain", "gain"),
    ):
        for end in ("lo", "hi"):
            if summary[f"{key}_{end}"] is not None:
                out[f"{name}_{end}"] = summary[f"{key}_{end}"]
    return {k: v for k, v in out.items() if v is not None}


def _metrics(label: str, res: dict) -> dict[str, float]:
    """The progress-line figures of one measurement."""
    if label == "target":
        return {"target_tok_s": res["tok_s"]}
    acc = eval_report.acceptance(res["counters"])
    prefix = "" if label == "trained" else f"{label}_"
    out = {
        f"{prefix}accept_len": acc["acceptance_length"],
        f"{prefix}accept_rate": acc["acceptance_rate"],
        ("draft_tok_s" if label == "trained" else f"{label}_tok_s"): res["tok_s"],
    }
    out.update({f"{prefix}accept_pos_{i}": r for i, r in enumerate(acc["per_position"])})
    return out


def report(
    results: dict[str, dict],
    s: Settings,
    rows,
    source: str,
    trained: Path,
    baseline: Path,
    version: str,
    cpu_build: bool,
) -> tuple[dict[str, Any], list[str]]:
    """(summary, lossless failure lines) of the three measurements."""
    ref = results["target"]["token_ids"]
    per: dict[str, dict] = {}
    failures = []
    for label in ("trained", "baseline"):
        res = results[label]
        acc = eval_report.acceptance(res["counters"])
        diff = eval_report.compare(ref, res["token_ids"], rows)
        per[label] = {
            **acc,
            "tok_s": res["tok_s"],
            "tokens": res["tokens"],
            "seconds": res["seconds"],
            "load_seconds": res["load_seconds"],
            **diff,
        }
        if diff["mismatched_prompts"]:
            failures.append(eval_report.mismatch_text(f"{label} draft", diff))
    tr, base, tgt = per["trained"], per["baseline"], results["target"]
    spread = intervals(results, s.k, rows, version)
    for label, m in (("trained", tr), ("baseline", base)):
        m["acceptance_length_interval"] = spread[label]["acceptance_length"]
        m["per_position_interval"] = spread[label]["per_position"]
    gain = tr["acceptance_length"] - base["acceptance_length"]
    (lo, hi), (blo, bhi), (glo, ghi) = (
        spread["trained"]["acceptance_length"] or (None, None),
        spread["baseline"]["acceptance_length"] or (None, None),
        spread["gain"] or (None, None),
    )
    summary = {
        "outputs": [str(s.out / "evaluate" / RESULTS), str(baseline)],
        "draft": str(trained),
        "baseline_draft": str(baseline),
        "num_speculative_tokens": s.k,
        "prompts": len(ref),
        "chats": len(set(rows)) if rows else None,  # validation prompts: the held-out chats they come from
        "answer_tokens": tgt["tokens"],  # the target's greedy answers, all prompts together
        "prompt_source": source,
        "max_tokens": s.max_tokens,
        "batch_size": min(s.batch_size, len(ref)),
        "tensor_parallel_size": s.tp,
        "dtype": s.dtype,
        "device": "cpu" if cpu_build else "cuda",
        "vllm_version": version,
        # The headline figures, flat (`eyas runs`, `eyas show`, the TUI and the demo read these).
        "acceptance_length": tr["acceptance_length"],
        "acceptance_length_lo": lo,
        "acceptance_length_hi": hi,
        "acceptance_rate": tr["acceptance_rate"],
        "per_position": tr["per_position"],
        "baseline_acceptance_length": base["acceptance_length"],
        "baseline_acceptance_length_lo": blo,
        "baseline_acceptance_length_hi": bhi,
        "baseline_acceptance_rate": base["acceptance_rate"],
        "baseline_per_position": base["per_position"],
        # Trained - untrained acceptance length, and its paired interval (the same draws).
        "gain": gain,
        "gain_lo": glo,
        "gain_hi": ghi,
        "interval": spread["how"],
        "min_gain": s.min_gain,
        "target_tok_s": tgt["tok_s"],
        "draft_tok_s": tr["tok_s"],
        "baseline_tok_s": base["tok_s"],
        "speedup": tr["tok_s"] / tgt["tok_s"] if tgt["tok_s"] else None,
        "lossless": not failures,
        "mismatched_prompts": tr["mismatched_prompts"] + base["mismatched_prompts"],
        "target": {
            "tok_s": tgt["tok_s"],
            "tokens": tgt["tokens"],
            "seconds": tgt["seconds"],
            "load_seconds": tgt["load_seconds"],
        },
        "trained": tr,
        "baseline": base,
    }
    summary["gate"] = "off" if s.min_gain <= 0 else ("failed" if gate(summary, s.min_gain) else "passed")
    return summary, failures


def intervals(results: dict[str, dict], k: int, rows: list[int] | None, version: str) -> dict[str, Any]:
    """The bootstrap's intervals of both drafts (evaluate/bootstrap.py), resampling held-out chats
    (`rows`: each prompt's; a prompt file's prompts are each their own unit); where vLLM gave
    no per-request counts, every interval None and a note that says why."""
    per_prompt = {label: results[label].get("per_prompt") for label in ("trained", "baseline")}
    how: dict[str, Any] = {
        "method": "percentile bootstrap",
        "level": bootstrap.LEVEL,
        "resamples": bootstrap.RESAMPLES,
        "seed": bootstrap.SEED,
        "unit": "chat" if rows else "prompt",
    }
    if not all(per_prompt.values()):
        how["note"] = f"vLLM {version} counts no drafts per request"
        none = {"acceptance_length": None, "per_position": [None] * k}
        return {"trained": none, "baseline": none, "gain": None, "how": how}
    for label, counts in per_prompt.items():
        total, agg = bootstrap.sum_counts(counts, k), results[label]["counters"]
        if (total["drafts"], total["accepted"], total["accepted_per_pos"]) != (
            agg["drafts"],
            agg["accepted"],
            list(agg["accepted_per_pos"][:k]),
        ):
            log.warning(
                "evaluate: the %s draft's per-prompt counts (%s) do not add up to vLLM's counters (%s); "
                "the intervals come from the per-prompt counts",
                label,
                total,
                agg,
            )
    out = bootstrap.bootstrap(per_prompt, k, rows or None, paired=("trained", "baseline"))
    how.update(units=out["units"], skipped=out["skipped"])
    return {"trained": out["trained"], "baseline": out["baseline"], "gain": out["gain"], "how": how}
