"""The whole pipeline through a real daemon: prepare -> extract -> vocab -> train with 2 ranks
on the tiny DeepseekV3 target, then evaluate (the trained draft as the target's EAGLE-3
speculator in vLLM's CPU build, beside its untrained baseline), then a training rank SIGKILLed
and the stage resumed from its checkpoint (FSDP this time). The trained draft reloads into
speculators."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from daemon_harness import private_daemon, wait_for
from runtoml import run_toml

from eyas.state import queries
from eyas.workers.models import assets

# Builds models and starts engines: `pytest -m "not slow"` leaves it out.
from eyas.workers.train import checkpoint

pytestmark = pytest.mark.slow

EYAS = str(Path(sys.executable).with_name("eyas"))
STAGES = ["prepare", "extract", "vocab", "train", "evaluate"]


def pipeline_toml(target: Path, data: Path) -> str:
    # A hang fails its stage within 3 minutes, with every live rank's stacks as the root cause,
    # instead of holding the test until its timeout. Each stage takes well under a minute here.
    return run_toml(
        "e2e",
        STAGES,
        target={"path": target, "dtype": "float32"},
        data={"path": data, "max_length": 128, "limit": 80, "validation_fraction": 0.15},
        extract={"batch_size": 8},
        resources={"ranks": 2, "devices": "cpu"},
        draft={"vocab_size": 256},
        train={"epochs": 2, "lr": 1e-3, "batch_tokens": 512},
        # The quality gate off: 2 epochs on 80 chats teach this draft little (a gain of 0.03 [0.00,
        # 0.09] over the untrained one, measured), and this run tests the pipeline's plumbing; the
        # gate has its own tests (tests/integration/workers/test_evaluate.py).
        evaluate={"max_tokens": 32, "min_gain": 0},
        stages={stage: {"stall_timeout": 180} for stage in STAGES},
    )


def train_only_toml(out: Path, target: Path) -> str:
    return run_toml(
        "kill",
        ["train"],
        output_dir=out,
        target={"path": target, "dtype": "float32"},
        resources={"ranks": 2, "devices": "cpu"},
        draft={"vocab_size": 256},
        train={"epochs": 3, "lr": 1e-3, "batch_tokens": 256, "strategy": "fsdp"},
        stages={"train": {"max_restarts": 1, "backoff": 0.5}},
    )


@pytest.fixture(scope="module")
def daemon():
    with private_daemon() as d:
        yield d


@pytest.fixture(scope="module")
def pipeline(daemon):
    made = assets.build_all(daemon.home / "assets")
    run_id = daemon.submit(pipeline_toml(made["tiny-deepseek"], made["chat.jsonl"]), "e2e.toml")
    # Under pytest-timeout's 600 s for the whole setup, so that a hang reports the run's state,
    # stacks and logs (Daemon.diagnose) rather than only pytest's timeout. It takes ~100 s here.
    run = daemon.wait_run(run_id, timeout=450)
    return run_id, run, made


def _metric(daemon, run_id: int, stage: str, attempt: int, name: str) -> list[float]:
    db = daemon.reader()
    try:
        return [v for _, _, v in queries.metric_series(db, run_id, stage, attempt, name)]
    finally:
        db.conn.close()


def test_the_whole_pipeline_runs_on_two_ranks(daemon, pipeline):
    run_id, run, made = pipeline
    daemon.expect_succeeded(run_id, run)
    stages = {s["name"]: s for s in run["stages"]}
    # Validation puts eyas doctor's preflight checks first (state/runconfig.py).
    assert list(stages) in (STAGES, ["preflight", *STAGES])
    stages.pop("preflight", None)
    for name, s in stages.items():
        assert (s["state"], s["attempts"], s["restarts"]) == ("succeeded", 1, 0), name
        (attempt,) = s["attempt_list"]
        world = 2 if name in ("extract", "train") else 1
        assert attempt["world_size"] == world and attempt["state"] == "succeeded"
        assert [(r["rank"], r["state"], r["exit_code"]) for r in attempt["ranks"]] == [
            (r, "exited", 0) for r in range(world)
        ], name
        assert s["summary"] and s["summary"]["outputs"], name
        assert all(Path(p).exists() for p in s["summary"]["outputs"]), name
    out = Path(run["output_dir"])
    prep = stages["prepare"]["summary"]
    assert prep["rows_out"] == 80 and prep["validation_rows"] == 12
    assert stages["extract"]["summary"]["samples"] == 80
    assert stages["vocab"]["summary"]["draft_vocab_size"] == 256
    tr = stages["train"]["summary"]
    assert (tr["world_size"], tr["strategy"], tr["train_rows"], tr["validation_rows"]) == (2, "ddp", 68, 12)
    assert tr["checkpoint"] == str(out / "train" / "checkpoints" / os.readlink(out / "train/checkpoints/best"))
    # Validation loss after training is below its value at step 0.
    assert tr["val_loss"] < tr["val_loss_initial"]
    assert stages["train"]["tok_s"] > 0 and run["tok_s"] > 0

    # The metrics went through the progress files into SQLite.
    loss = _metric(daemon, run_id, "train", 1, "loss")
    steps = _metric(daemon, run_id, "train", 1, "step")
    assert loss and steps[-1] == tr["steps"] and all(v > 0 for v in loss)
    for name in ("acc_0", "acc_2", "cond_acc_1", "lr", "step_tok_s"):
        assert _metric(daemon, run_id, "train", 1, name), name
    val = _metric(daemon, run_id, "train", 1, "val_loss")
    assert val[0] == pytest.approx(tr["val_loss_initial"]) and val[-1] == pytest.approx(tr["val_loss"])
    assert _metric(daemon, run_id, "extract", 1, "tokens")


def test_the_trained_draft_reloads_into_speculators(pipeline):
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel

    _, run, made = pipeline
    ckpt = Path({s["name"]: s for s in run["stages"]}["train"]["summary"]["checkpoint"])
    model = Eagle3DraftModel.from_pretrained(str(ckpt))
    saved = load_file(ckpt / "model.safetensors")
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    assert model.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    assert model.config.speculators_config.verifier.name_or_path == str(made["tiny-deepseek"])


def test_evaluate_measures_the_trained_draft_in_vllm_and_records_it(daemon, pipeline):
    run_id, run, made = pipeline
    stages = {s["name"]: s for s in run["stages"]}
    ev, tr = stages["evaluate"]["summary"], stages["train"]["summary"]
    out = Path(run["output_dir"])
    # The train stage's draft, as the target's EAGLE-3 speculator in vLLM's CPU build, beside the
    # untrained draft training started from; every turn of the 12 validation chats (25 prompts),
    # greedy, k = 3; the quality gate off (pipeline_toml says why).
    assert (ev["draft"], ev["baseline_draft"]) == (tr["checkpoint"], str(out / "evaluate" / "baseline-draft"))
    assert (ev["prompts"], ev["chats"], ev["prompt_source"], ev["num_speculative_tokens"], ev["max_tokens"]) == (
        25,
        12,
        "validation split",
        3,
        32,
    )
    assert (stages["evaluate"]["state"], ev["gate"], ev["min_gain"]) == ("succeeded", "off", 0), ev
    assert ev["acceptance_length_lo"] <= ev["acceptance_length"] <= ev["acceptance_length_hi"]
    assert (ev["device"], ev["tensor_parallel_size"], ev["vllm_version"]) == ("cpu", 1, "0.32.0")
    assert (ev["lossless"], ev["mismatched_prompts"]) == (True, 0)
    assert ev["trained"]["drafts"] > 0 and ev["trained"]["draft_tokens"] == 3 * ev["trained"]["drafts"]
    assert ev["acceptance_length"] == pytest.approx(1 + ev["trained"]["accepted_tokens"] / ev["trained"]["drafts"])
    assert len(ev["per_position"]) == len(ev["baseline_per_position"]) == 3
    assert ev["target_tok_s"] > 0 and ev["draft_tok_s"] > 0 and ev["baseline_tok_s"] > 0
    results = json.loads((out / "evaluate" / "results.json").read_text())
    assert results["outputs_by_engine"]["trained"] == results["outputs_by_engine"]["target"]

    # The figures went through the progress file into SQLite's metrics.
    for name, value in (
        ("accept_len", ev["acceptance_length"]),
        ("baseline_accept_len", ev["baseline_acceptance_length"]),
        ("accept_pos_0", ev["per_position"][0]),
        ("target_tok_s", ev["target_tok_s"]),
        ("draft_tok_s", ev["draft_tok_s"]),
        ("baseline_tok_s", ev["baseline_tok_s"]),
        ("lossless", 1.0),
        ("mismatched_prompts", 0.0),
    ):
        assert _metric(daemon, run_id, "evaluate", 1, name) == [pytest.approx(value)], name

    # The engines' output is in the rank's log (vLLM loaded the draft as a drafter).
    log = (Path(stages["evaluate"]["attempt_list"][0]["dir"]) / "rank-0.log").read_text()
    assert "Loading drafter model" in log and "eyas evaluate [trained]: 25 prompts" in log

    # And it reaches the history: `eyas runs` and `eyas show`.
    env = {**os.environ, "EYAS_HOME": str(daemon.home)}
    listed = json.loads(
        subprocess.run([EYAS, "runs", "--json"], env=env, capture_output=True, text=True, check=True).stdout
    )
    assert [r["accept"] for r in listed if r["id"] == run_id] == [pytest.approx(ev["acceptance_length"])]
    shown = subprocess.run([EYAS, "show", str(run_id)], env=env, capture_output=True, text=True, check=True).stdout
    assert f"  trained    {ev['acceptance_length']:10.3f}" in shown and "lossless: yes" in shown


def test_a_sigkilled_training_rank_resumes_from_the_checkpoint(daemon, pipeline):
    _, run, made = pipeline
    out = daemon.home / "kill-out"
    for stage in ("prepare", "extract", "vocab"):
        shutil.copytree(Path(run["output_dir"]) / stage, out / stage)
    run_id = daemon.submit(train_only_toml(out, made["tiny-deepseek"]), "kill.toml")
    root = out / "train" / "checkpoints"
    wait_for(lambda: checkpoint.latest(root), 300, interval=0.02, what="the first checkpoint")
    attempt_dir = Path(daemon.ranks(run_id, "train")[0]["log_path"]).parent
    pid = json.loads((attempt_dir / "rank-1.proc.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not _alive(pid), 30, what="rank 1 to die")
    resume_point = checkpoint.latest(root)

    final = daemon.wait_run(run_id, timeout=600)
    assert final["state"] == "succeeded", json.dumps(final, default=str)[:3000]
    assert [s["name"] for s in final["stages"]] in (["train"], ["preflight", "train"])  # preflight: added
    stage = final["stages"][-1]
    assert (stage["attempts"], stage["restarts"]) == (2, 1)
    first, second = stage["attempt_list"]
    assert first["state"] == "failed" and second["state"] == "succeeded"
    # Rank 1's death is on record. (The root cause is the earliest failure by time, and rank 0's
    # gloo error about its lost peer can be stamped a few milliseconds before rank 1's monitor
    # records the SIGKILL, so it is not always the one named root cause.)
    db = daemon.reader()
    try:
        errors = [e for e in queries.errors(db, run_id, "train") if e["attempt"] == 1]
    finally:
        db.conn.close()
    assert [(e["type"], e["source"]) for e in errors if e["rank"] == 1] == [("SIGKILL", "signal")], errors
    s = stage["summary"]
    assert (s["resumed_from"], s["resumed_at_step"]) == (resume_point.name, resume_point.global_step)
    assert resume_point.global_step > 0 and s["steps_this_attempt"] == s["steps"] - resume_point.global_step
    assert s["strategy"] == "fsdp" and s["val_loss"] < s["val_loss_initial"]
    # The retry's first step is the one after the checkpoint, not step 1.
    steps = _metric(daemon, run_id, "train", 2, "step")
    assert steps[0] == resume_point.global_step + 1 and steps[-1] == s["steps"]
    # Heartbeat lines (model build, checkpoint saves) carry no counts: the first count line matters.
    records = [
        rec
        for line in (Path(second["dir"]) / "rank-0.progress.jsonl").read_text().splitlines()
        if "heartbeat" not in (rec := json.loads(line))
    ]
    assert records[0]["tokens"] > 0 and records[0]["samples"] > 0  # counted from the checkpoint on
    assert sorted(p.name for p in root.iterdir()) == ["best", "epoch-1", "epoch-2", "epoch-3"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
