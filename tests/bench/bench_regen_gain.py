"""What regeneration is worth: the demo's draft trained on the dataset's answers against the same draft trained on the target's own answers, both measured in vLLM on the same held-out prompts.

The demo's target and chats (eyas demo's assets, built once into a temp dir and kept): the chats
stand for a public dataset written by another model, and the target answers in its own voice
(eyas.workers.models.assets: fit_to_chats, FIT_VOICE). Two runs of workers/examples/demo.toml
through one real daemon, the same prompts, budget (epochs, lr, batch tokens) and seed:

- dataset: prepare -> extract -> vocab -> train -> evaluate, the draft trained on the chats'
  answers;
- regenerated: prepare -> regenerate -> extract -> vocab -> train -> evaluate, trained on the
  target's answers to the same prompts (greedy, demo.toml's [regenerate]).

Both evaluate on the same prompt token ids: every assistant turn's prompt of the held-out chats
as the regenerated run's evaluate takes them (as `eyas demo` does), passed to the dataset run as
evaluate.prompts. Regeneration keeps which rows are held out (the split is prepare's,
renumbered past rows that failed: none here) and each chat's first prompt; a later turn's
prompt holds the target's earlier answers where the dataset's split holds the dataset's. The
target is served that way (a conversation holds its own answers), and it answers the dataset's
answers in its history erratically (its head never saw them: fit_to_chats), so the prompts are
the regenerated split's. The bench checks and prints how many prompts the two splits share.

Printed: each run's acceptance length with its 95 % bootstrap interval (held-out chats
resampled, evaluate/bootstrap.py: the stage's method, computed here on both runs' per-prompt
counts so the two use the same units), its untrained baseline, its per-position rates, and the
ratio regenerated / dataset with a paired bootstrap interval (the same chats drawn for both).
Target: ratio >= 1.2. A few of the target's greedy answers are printed, to show its voice.

Run: python tests/bench/bench_regen_gain.py [--epochs N] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "support"))

from daemon_harness import private_daemon  # noqa: E402

CACHE = Path(tempfile.gettempdir()) / "eyas-bench-regen-gain-v1"
TARGET_RATIO = 1.2
STAGES = ["prepare", "extract", "vocab", "train", "evaluate"]


def toml(made: dict, name: str, regenerate: bool, prompts: Path | None, epochs: int | None) -> str:
    """demo.toml as `eyas demo` submits it on CPU, with or without regenerate, the quality gate
    off (this bench wants the figures, whatever they are) and evaluate.prompts where given."""
    text = (REPO / "workers" / "examples" / "demo.toml").read_text()
    text = text.replace('"assets/tiny-deepseek"', json.dumps(str(made["tiny-deepseek"])))
    text = text.replace('"assets/chat.jsonl"', json.dumps(str(made["chat.jsonl"])))
    # No preflight: this bench measures the drafts, not the run (eyas doctor's checks take a minute).
    text = text.replace('name = "demo"', f'name = "{name}"\npreflight = false')
    pipeline = [*STAGES[:1], *(["regenerate"] if regenerate else []), *STAGES[1:]]
    text, n = re.subn(r"^pipeline = \[.*\]", f"pipeline = {json.dumps(pipeline)}", text, flags=re.M)
    assert n == 1, "demo.toml has no pipeline line"
    if "[regenerate]" not in text:  # demo.toml without regenerate: its defaults, greedy
        text += "\n[regenerate]\nmax_tokens = 64\n"
    text, n = re.subn(r"^min_gain = .*$", "min_gain = 0", text, flags=re.M)
    assert n == 1, "demo.toml has no evaluate.min_gain line"
    if epochs is not None:
        text, n = re.subn(r"^epochs = \d+", f"epochs = {epochs}", text, flags=re.M)
        assert n == 1
    if prompts is not None:
        text, n = re.subn(r"^max_prompts = .*$", f"prompts = {json.dumps(str(prompts))}", text, flags=re.M)
        assert n == 1, "demo.toml has no evaluate.max_prompts line"
    return text


def submit(daemon, text: str, name: str, timeout: float) -> tuple[dict, float]:
    t0 = time.monotonic()
    run_id = daemon.submit(text, f"{name}.toml")
    run = daemon.expect_succeeded(run_id, daemon.wait_run(run_id, timeout=timeout))
    return run, time.monotonic() - t0


def results(run: dict) -> dict:
    return json.loads((Path(run["output_dir"]) / "evaluate" / "results.json").read_text())


def ratio_interval(a: list[dict], b: list[dict], groups: list, k: int, resamples: int = 2000, seed: int = 0):
    """A paired percentile bootstrap of acceptance(b) / acceptance(a): the same units drawn for
    both (evaluate/bootstrap.py's units, draws and quantiles)."""
    from eyas.workers.evaluate import bootstrap

    ua, ub = bootstrap.units(a, groups, k), bootstrap.units(b, groups, k)
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        draw = [rng.randrange(len(ua)) for _ in ua]
        da, db = sum(ua[j]["drafts"] for j in draw), sum(ub[j]["drafts"] for j in draw)
        if da and db:
            la = 1 + sum(ua[j]["accepted"] for j in draw) / da
            lb = 1 + sum(ub[j]["accepted"] for j in draw) / db
            ratios.append(lb / la)
    return bootstrap.interval(ratios)


def acceptance(counts: list[dict], k: int) -> tuple[float, list[float]]:
    from eyas.workers.evaluate import bootstrap

    total = bootstrap.sum_counts(counts, k)
    return 1 + total["accepted"] / total["drafts"], [n / total["drafts"] for n in total["accepted_per_pos"]]


def check_prompts(regen_run: dict, dataset_run: dict, res: dict) -> str:
    """What regeneration kept of the held-out prompts: the rows held out, and each turn's prompt
    (`res`: the regenerated run's evaluate results, the prompts both runs answered)."""
    from eyas.workers.evaluate.prompts import from_validation

    out_b, out_a = Path(regen_run["output_dir"]), Path(dataset_run["output_dir"])
    split_a = json.loads((out_a / "prepare" / "splits.json").read_text())
    split_b = json.loads((out_b / "regenerate" / "splits.json").read_text())
    assert split_b["rows_left_out"] == 0, split_b
    assert split_a["validation"] == split_b["validation"], "regenerate changed which rows are held out"
    theirs, rows = from_validation(out_a / "prepare", 0)
    assert rows == res["rows"], "regenerate changed the held-out rows' turns"
    firsts = [i for i, r in enumerate(rows) if i == 0 or rows[i - 1] != r]
    same = [i for i, p in enumerate(theirs) if p == res["prompt_token_ids"][i]]
    assert all(i in same for i in firsts), "regenerate changed a first turn's prompt"
    return (
        f"held-out rows: the same {len(split_a['validation'])} chats in both runs; of their {len(rows)} prompts "
        f"{len(same)} are the same in the dataset's split (every first turn: {len(firsts)}); the others hold the "
        "target's earlier answers in the regenerated split, which both runs answer"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=None, help="train.epochs for both runs (default: demo.toml's)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds each run may take")
    parser.add_argument("--keep", action="store_true", help="keep the daemon's state directory (EYAS_TEST_KEEP_HOME)")
    args = parser.parse_args()
    if args.keep:
        os.environ["EYAS_TEST_KEEP_HOME"] = "1"
    from eyas.cli.demo import FIT_STEPS
    from eyas.workers.models import assets

    made = assets.build_all(CACHE / "assets", fit_steps=FIT_STEPS, only=("tiny-deepseek", "chat.jsonl"))
    print(f"assets: {CACHE / 'assets'} ({json.loads((made['tiny-deepseek'] / assets.MARKER).read_text())})")
    with private_daemon() as daemon:
        print(f"state: {daemon.home}", flush=True)
        regen_run, regen_s = submit(daemon, toml(made, "regenerated", True, None, args.epochs), "regen", args.timeout)
        res_b = results(regen_run)
        prompts = daemon.home / "held-out-prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in res_b["prompt_token_ids"]))
        dataset_run, dataset_s = submit(
            daemon, toml(made, "dataset", False, prompts, args.epochs), "dataset", args.timeout
        )
        res_a = results(dataset_run)
        assert res_a["prompt_token_ids"] == res_b["prompt_token_ids"]
        print(check_prompts(regen_run, dataset_run, res_b))
        figures(made, dataset_run, regen_run, res_a, res_b, dataset_s, regen_s)
    return 0


def figures(made, dataset_run, regen_run, res_a, res_b, dataset_s, regen_s) -> None:
    from transformers import AutoTokenizer

    from eyas.workers.evaluate import bootstrap

    k = res_b["num_speculative_tokens"]
    rows = res_b["rows"]  # each prompt's held-out chat: the bootstrap's unit, in both runs
    per = {
        "dataset": res_a["per_prompt_by_engine"]["trained"],
        "regenerated": res_b["per_prompt_by_engine"]["trained"],
        "untrained (dataset run)": res_a["per_prompt_by_engine"]["baseline"],
        "untrained (regenerated run)": res_b["per_prompt_by_engine"]["baseline"],
    }
    spread = bootstrap.bootstrap(per, k, rows, paired=("regenerated", "dataset"))
    stages = {name: {s["name"]: s for s in r["stages"]} for name, r in (("dataset", dataset_run), ("regen", regen_run))}
    rg = stages["regen"]["regenerate"]["summary"]
    print(
        f"regenerate: {rg['rows']} rows, {rg['rows_out']} out, {rg['rows_finished']} finished, "
        f"{rg['rows_cut_max_tokens']} cut at max_tokens; {rg['tokens_generated']} tokens generated"
    )
    for name, run_s in (("dataset", dataset_s), ("regen", regen_s)):
        tr = stages[name]["train"]["summary"]
        print(f"{name} run: {run_s:.0f} s; train val loss {tr['val_loss']:.4f} (from {tr['val_loss_initial']:.4f})")
    print(f"{len(rows)} prompts from {len(set(rows))} held-out chats, k = {k}, {res_b['max_tokens']} tokens each")
    for label, counts in per.items():
        length, rates = acceptance(counts, k)
        lo, hi = spread[label]["acceptance_length"]
        print(
            f"  {label:28s} acceptance length {length:.3f} [{lo:.3f}, {hi:.3f}]  "
            f"per position {' '.join(f'{r:.2f}' for r in rates)}"
        )
    a = acceptance(per["dataset"], k)[0]
    b = acceptance(per["regenerated"], k)[0]
    lo, hi = ratio_interval(per["dataset"], per["regenerated"], rows, k)
    glo, ghi = spread["gain"]
    print(f"regenerated - dataset = {b - a:.3f} [{glo:.3f}, {ghi:.3f}]")
    verdict = "meets" if b / a >= TARGET_RATIO else "misses"
    print(f"ratio regenerated / dataset = {b / a:.3f} [{lo:.3f}, {hi:.3f}]: {verdict} the {TARGET_RATIO} target")
    tokenizer = AutoTokenizer.from_pretrained(made["tiny-deepseek"])
    print("the target's greedy answers to the first held-out prompts:")
    for ids in res_b["outputs_by_engine"]["target"][:8]:
        print(f"  {tokenizer.decode(ids)!r}")


if __name__ == "__main__":
    sys.exit(main())
