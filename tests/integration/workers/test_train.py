"""The train stage in-process (one rank) on real prepare/extract/vocab outputs of the tiny
DeepseekV3 target: speculators-format checkpoints, metrics, validation, exact resume, atomic
saves under SIGKILL, and clear errors. The multi-rank paths run through a real daemon in
tests/e2e/test_pipeline_e2e.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from train_pipeline import build_inputs, context, copy_inputs, progress_records, run_stage, summary

from eyas.workers.stages import train
from eyas.workers.train import checkpoint
from eyas.workers.train import data as train_data

# Builds models and starts engines: `pytest -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: two-thread OpenMP on two shared cores is many times slower, and
    bitwise-equal resumes need the same reduction order in both runs."""
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # the stages' own thread rule then keeps out
    yield
    torch.set_num_threads(threads)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("train")
    base, cfg = build_inputs(root)
    return root, base, cfg


@pytest.fixture(scope="module")
def trained(inputs):
    """One uninterrupted 2-epoch run with noise and a mid-epoch checkpoint every 3 steps."""
    root, base, cfg = inputs
    out = copy_inputs(base, root / "plain")
    cfg = dict(cfg, train=dict(cfg["train"], noise_std=0.05))
    ctx = run_stage(train, "train", out, cfg, options={"save_every": 3})
    return out, cfg, ctx


def test_trains_and_writes_speculators_checkpoints(inputs, trained):
    from speculators.models.eagle3 import Eagle3DraftModel

    _, base, _ = inputs
    out, cfg, ctx = trained
    s = summary(ctx)
    root = out / "train" / "checkpoints"
    data_config = json.loads((base / "extract" / "data_config.json").read_text())
    steps = s["steps"]
    # Per epoch, plus the best; the mid-epoch ones are dropped once an epoch checkpoint follows.
    assert sorted(p.name for p in root.iterdir()) == ["best", "epoch-1", "epoch-2"]
    history = s["validation"]
    assert [h["step"] for h in history] == [0, steps // 2, steps]
    assert s["val_loss_initial"] == history[0]["val_loss"] and s["val_loss"] == history[-1]["val_loss"]
    assert s["val_loss"] < s["val_loss_initial"]
    best = min(history[1:], key=lambda h: h["val_loss"])
    assert os.readlink(root / "best") == f"epoch-{int(best['epoch'])}"
    assert s["outputs"] == [str(root / f"epoch-{int(best['epoch'])}")] + (
        [str(root / "epoch-2")] if best["epoch"] != 2 else []
    )
    assert (s["resumed_from"], s["steps_this_attempt"], s["world_size"], s["strategy"]) == (None, steps, 1, "single")

    cfg_json = json.loads((root / "epoch-2" / "config.json").read_text())
    assert cfg_json["speculators_model_type"] == "eagle3"
    assert cfg_json["eagle_aux_hidden_state_layer_ids"] == data_config["layer_ids"][:-1] == [2, 4, 5]
    assert cfg_json["draft_vocab_size"] == 256
    assert cfg_json["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg_json["transformer_layer_config"]["num_hidden_layers"] == 1
    assert cfg_json["transformer_layer_config"]["layer_types"] == ["full_attention"]
    weights = load_file(root / "epoch-2" / "model.safetensors")
    assert not [k for k in weights if k.startswith("verifier_")]  # speculators never saves them
    # The only weights file at the top: vLLM loads every *.safetensors there.
    assert sorted(p.name for p in (root / "epoch-2").glob("*.safetensors")) == ["model.safetensors"]
    assert sorted(p.name for p in (root / "epoch-2" / "training").iterdir()) == [
        "optimizer.safetensors",
        "trainer_state.json",
    ]
    assert {"d2t", "t2d", "fc.weight", "lm_head.weight", "embed_tokens.weight"} <= set(weights)
    assert torch.equal(weights["d2t"], torch.from_numpy(np.load(base / "vocab" / "d2t-256.npy")))

    # speculators loads the directory back, verifier weights from the target included.
    model = Eagle3DraftModel.from_pretrained(str(root / "epoch-2"))
    state = model.state_dict()
    for k, v in weights.items():
        assert torch.equal(state[k], v), k
    target = load_file(os.path.join(cfg["target"]["path"], "model.safetensors"))
    t2d = torch.from_numpy(np.load(base / "vocab" / "t2d-256.npy"))
    assert torch.equal(state["verifier_lm_head.weight"], target["lm_head.weight"][t2d])
    assert torch.equal(state["verifier_norm.weight"], target["model.norm.weight"])


def test_reports_speculators_metrics_per_step_and_validation(trained):
    _, _, ctx = trained
    s = summary(ctx)
    records = progress_records(ctx)
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == list(range(1, s["steps"] + 1))  # min_interval=0: every step
    for name in (
        "loss",
        "loss_0",
        "loss_2",
        "acc_0",
        "acc_1",
        "acc_2",
        "cond_acc_0",
        "cond_acc_2",
        "lr",
        "grad_norm",
        "step_tok_s",
        "epoch",
    ):
        assert all(name in r for r in steps), name
    first = steps[0]
    # speculators' loss is the sum over the TTT steps.
    assert first["loss"] == pytest.approx(first["loss_0"] + first["loss_1"] + first["loss_2"], rel=1e-5)
    # Full accuracy at step k needs every step up to k right: it can only fall with k.
    assert all(r["acc_0"] >= r["acc_1"] >= r["acc_2"] for r in steps)
    assert first["lr"] == 1e-3 and steps[-1]["lr"] < first["lr"]  # linear decay, no warmup
    vals = [r for r in records if "val_step" in r]
    assert [r["val_step"] for r in vals] == [0, s["steps"] // 2, s["steps"]]
    assert {"val_loss", "val_acc_0", "val_cond_acc_2"} <= set(vals[0])
    last = records[-1]
    assert last["samples"] == last["samples_total"] and last["tokens"] == last["tokens_total"] > 0
    assert s["tokens_this_attempt"] == last["tokens"]


def test_a_retry_resumes_from_the_checkpoint_and_ends_where_an_uninterrupted_run_ends(inputs, trained, monkeypatch):
    root, base, _ = inputs
    plain_out, cfg, plain_ctx = trained
    out = copy_inputs(base, root / "resumed")
    total = summary(plain_ctx)["steps"]

    from eyas.workers.train import loop as train_loop

    real_save = train_loop.Trainer._save

    def save_then_die(self, name, pos):
        real_save(self, name, pos)
        if name == "step-3":
            raise KeyboardInterrupt("killed after step-3 was saved")

    monkeypatch.setattr(train_loop.Trainer, "_save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run_stage(train, "train", out, cfg, options={"save_every": 3})
    monkeypatch.setattr(train_loop.Trainer, "_save", real_save)
    assert checkpoint.latest(out / "train" / "checkpoints").name == "step-3"

    ctx = run_stage(train, "train", out, cfg, attempt=2, options={"save_every": 3})
    s = summary(ctx)
    assert (s["resumed_from"], s["resumed_at_step"], s["steps_this_attempt"]) == ("step-3", 3, total - 3)
    records = progress_records(ctx)
    assert records[0]["samples"] > 0 and records[0]["tokens"] > 0  # counted from the checkpoint on
    assert [r["step"] for r in records if "step" in r][0] == 4
    # Same batches, same noise, same optimizer and schedule state: the same weights, bit for bit.
    for name in ("epoch-1", "epoch-2"):
        a = load_file(plain_out / "train" / "checkpoints" / name / "model.safetensors")
        b = load_file(out / "train" / "checkpoints" / name / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert s["validation"] == summary(plain_ctx)["validation"]


def test_resuming_a_finished_run_trains_nothing_more(trained):
    out, cfg, first = trained
    root = out / "train" / "checkpoints"
    best = os.readlink(root / "best")
    # As if killed between a checkpoint and its `best` link: the trainer state says which is best.
    checkpoint.set_best(root, "epoch-2" if best == "epoch-1" else "epoch-1")
    ctx = run_stage(train, "train", out, cfg, attempt=3, options={"save_every": 3})
    s = summary(ctx)
    assert (s["resumed_from"], s["steps_this_attempt"]) == ("epoch-2", 0)
    assert os.readlink(root / "best") == best and s["checkpoint"] == summary(first)["checkpoint"]


def test_refuses_to_resume_another_setup(inputs, trained):
    out, cfg, _ = trained
    other = dict(cfg, train=dict(cfg["train"], batch_tokens=640))
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"written by another training setup \(batch_tokens: 512 "
        r"there, 640 now\); delete .*/train/checkpoints to start over",
    ):
        run_stage(train, "train", out, other)


_KILL_MID_SAVE = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from eyas.workers.train import checkpoint

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 2)

        def save_pretrained(self, path, state_dict, safe_serialization):
            path.mkdir(parents=True)
            (path / "config.json").write_text("{}")
            (path / "model.safetensors").write_bytes(b"partial")
            print("WRITING", flush=True)
            time.sleep(60)      # killed here, mid-save

    m = Model()
    checkpoint.save(Path(sys.argv[1]), "epoch-3", m, m.state_dict(), {"state": {}, "param_groups": []},
                    {"global_step": 3})
""")


def test_a_kill_mid_save_never_leaves_a_complete_looking_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    p = subprocess.Popen([sys.executable, "-c", _KILL_MID_SAVE, str(root)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "WRITING"
    os.kill(p.pid, signal.SIGKILL)
    p.wait(30)
    leftovers = sorted(e.name for e in root.iterdir())
    assert len(leftovers) == 1 and leftovers[0].startswith(".tmp-epoch-3-")
    assert checkpoint.latest(root) is None and checkpoint.all_checkpoints(root) == []
    assert checkpoint.clean(root) == 1 and list(root.iterdir()) == []


def test_a_checkpoint_directory_without_its_trainer_state_is_not_one(tmp_path):
    root = tmp_path / "checkpoints"
    d = root / "epoch-1"
    d.mkdir(parents=True)
    (d / checkpoint.TRAINING).mkdir()
    for name in (checkpoint.CONFIG, checkpoint.MODEL, checkpoint.OPTIMIZER):
        (d / name).write_text("x")
    assert checkpoint.latest(root) is None
    (d / checkpoint.STATE).write_text(json.dumps({"format": checkpoint.FORMAT, "global_step": 7}))
    assert checkpoint.latest(root).global_step == 7


def test_optimizer_state_round_trips_through_safetensors_and_json():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, opt)
    tensors, rest = checkpoint.flatten_optimizer(sd)
    assert sorted(tensors) == sorted(
        f"state/{p}/{k}"
        for p in ("0.weight", "0.bias", "1.weight", "1.bias")
        for k in ("step", "exp_avg", "exp_avg_sq")
    )
    json.dumps(rest)  # the rest is plain JSON
    back = checkpoint.unflatten_optimizer(tensors, json.loads(json.dumps(rest)))
    assert back["param_groups"][0]["betas"] == (0.8, 0.9)
    assert back["param_groups"][0]["params"] == sd["param_groups"][0]["params"]
    for p, values in sd["state"].items():
        for k, v in values.items():
            assert torch.equal(back["state"][p][k], v)


def test_packing_is_speculators_and_the_same_on_every_call():
    lengths = [30, 100, 70, 20, 90, 60, 50, 40, 80, 10]
    r0 = train_data.plan(lengths, 200, 2, 0, seed=1, epoch=0)
    r1 = train_data.plan(lengths, 200, 2, 1, seed=1, epoch=0)
    assert len(r0) == len(r1) > 0  # every rank runs the same steps
    assert all(sum(lengths[i] for i in b) <= 200 for b in r0 + r1)
    assert len({i for b in r0 + r1 for i in b}) == sum(len(b) for b in r0 + r1)  # no row twice
    assert train_data.plan(lengths, 200, 2, 0, seed=1, epoch=0) == r0
    assert train_data.plan(lengths, 200, 2, 0, seed=1, epoch=1) != r0  # reshuffled per epoch
    assert train_data.plan([5], 200, 2, 0, seed=1, epoch=0) == []
    assert train_data.batch_tokens_of([1, 2], lengths, 1000) == 99 + 69
    assert train_data.batch_tokens_of([1, 2], lengths, 150) == 150


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"schedule": "linear"},
            "stages.train.options.schedule: unknown key; did you mean 'stages.train.options.scheduler'",
        ),
        (
            {"scheduler": "step"},
            "stages.train.options.scheduler: unknown value 'step'; use one of: linear, cosine, constant",
        ),
        ({"save_every": "3"}, "stages.train.options.save_every: expected an integer, got string '3'"),
        ({"log_every": 0}, "stages.train.options.log_every: 0 is out of range; use an integer >= 1"),
        ({"attention": "simple_flex_attention"}, 'flex attention has no CPU backward; use "sdpa" on CPU'),
    ],
)
def test_bad_options_get_one_clear_line(inputs, tmp_path, options, message):
    _, _, cfg = inputs
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        train.settings(context("train", tmp_path / "out", cfg, options=options))


def test_missing_inputs_name_the_stage_to_run(inputs, tmp_path):
    _, base, cfg = inputs
    out = tmp_path / "out"
    with pytest.raises(train_data.DataError, match="prepare/dataset: no prepared dataset; run the prepare stage first"):
        run_stage(train, "train", out, cfg)
    copy_inputs(base, out)
    for f in (out / "vocab").iterdir():
        f.unlink()
    from eyas.workers.train.model import DraftError

    with pytest.raises(DraftError, match=r"no d2t-256.npy / t2d-256.npy; run the vocab stage first"):
        run_stage(train, "train", out, cfg)
    copy_inputs(base, tmp_path / "b")
    (tmp_path / "b" / "extract" / "hidden_states" / "hs_3.safetensors").unlink()
    with pytest.raises(
        train_data.DataError,
        match=r"samples have no hidden-states file \(first: hs_3.safetensors\); "
        "run the extract stage to completion",
    ):
        run_stage(train, "train", tmp_path / "b", cfg)
