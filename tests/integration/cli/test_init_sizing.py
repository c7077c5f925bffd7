"""`eyas init` sizes training to the data and `eyas validate` counts a config's optimizer steps:
the real commands on the demo's tiny DeepSeek-V3 (random weights, its own tokenizer) and the
demo's synthetic chats, 60 and 300 of them; the real prepare stage then makes the dataset, and the
steps the train stage would take are counted with its own batch plan (workers/train/data.py:
plan, speculators' sampler) to hold init's promise and validate's numbers to it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from doctor_models import EYAS
from train_pipeline import run_stage

from eyas.state import trainsteps
from eyas.state.runconfig import load
from eyas.workers.models import assets
from eyas.workers.stages import prepare
from eyas.workers.train import data as train_data

MIN = trainsteps.MIN_STEPS


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return assets.build_model(tmp_path_factory.mktemp("sizing") / "tiny-deepseek", "deepseek_v3")


def eyas(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    fake = tmp_path / "nvml.json"
    fake.write_text(json.dumps({"error": "LibraryNotFound"}))  # no GPU: a CPU run
    env = {**os.environ, "EYAS_HOME": str(tmp_path / "home"), "EYAS_FAKE_NVML": str(fake)}
    return subprocess.run([EYAS, *argv], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


def init(tmp_path: Path, target: Path, chats: int) -> tuple[subprocess.CompletedProcess, dict, str]:
    assets.write_dataset(tmp_path / "chat.jsonl", n=chats, malformed=False)
    made = eyas(tmp_path, "init", str(target), "--data", "chat.jsonl", "-o", "run.toml")
    assert made.returncode == 0, made.stderr
    text = (tmp_path / "run.toml").read_text()
    return made, tomllib.loads(text), text


def prepared_steps(tmp_path: Path, toml: Path, out: Path) -> tuple[list[int], int]:
    """Run the real prepare stage on the config; (the training rows' lengths, the optimizer
    steps the train stage's own plan makes of them with the config's [train] and ranks)."""
    from datasets import load_from_disk

    cfg = load(toml).to_dict()
    run_stage(prepare, "prepare", out, cfg)
    lengths = [int(n) for n in load_from_disk(str(out / "prepare" / "dataset")).with_format(None)["seq_len"]]
    train_rows, _ = train_data.read_splits(out / "prepare", len(lengths))
    train = [lengths[i] for i in train_rows]
    tr, ranks = cfg["train"], cfg["resources"]["ranks"]
    plans = [train_data.plan(train, tr["batch_tokens"], ranks, 0, tr["seed"], e) for e in range(tr["epochs"])]
    return train, sum(len(p) for p in plans)


def with_train(text: str, **keys) -> str:
    """The config text with [train]'s keys set (the issue's config: init's defaults before sizing)."""
    for key, value in keys.items():
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text, count=1)
    return text


def test_60_chats_are_too_small_and_init_says_so_in_the_file_and_on_the_terminal(tmp_path, target):
    made, run, text = init(tmp_path, target, 60)
    train = run["train"]
    # The smallest batch the rule uses and the most epochs, and still under the minimum: said.
    assert (train["epochs"], train["batch_tokens"]) == (trainsteps.MAX_EPOCHS, trainsteps.MIN_BATCH_TOKENS)
    assert made.stderr.count("eyas init: warning: the data is too small for a useful draft: ") == 1
    assert "# WARNING: the data is too small for a useful draft: " in text
    said = re.search(r"This schedule stops at 20 epochs, ~(\d+) steps\. About 10240 training tokens", made.stderr)
    assert said, made.stderr
    _, steps = prepared_steps(tmp_path, tmp_path / "run.toml", tmp_path / "out")
    assert steps < MIN  # what it warned of
    # init's count (an estimate on the data file's text) errs low, within 25 % of the real plan.
    assert 0.75 * steps <= int(said.group(1)) <= steps
    assert train["warmup_steps"] == round(0.05 * int(said.group(1)))
    assert train["lr"] == 1e-3  # the shortest schedules take the longest steps
    assert f"~{said.group(1)} steps: 20 epochs × ~" in text


def test_300_chats_train_at_least_the_minimum_steps(tmp_path, target):
    """The demo's data size: not too small; the train stage's own plan on the really prepared
    dataset takes at least the minimum, and `eyas validate` counts them from that dataset."""
    made, run, text = init(tmp_path, target, 300)
    assert "warning" not in made.stderr and "WARNING" not in text
    train = run["train"]
    assert train["batch_tokens"] == trainsteps.MIN_BATCH_TOKENS and train["epochs"] > 3
    stated = int(re.search(r"(?m)^epochs = \d+ +# passes over the data: ~(\d+) steps", text).group(1))
    lengths, steps = prepared_steps(tmp_path, tmp_path / "run.toml", tmp_path / "out")
    assert steps >= MIN and stated >= MIN
    assert stated <= steps  # the estimate errs low: the run takes at least what the file says
    assert train["lr"] == float(f"{1e-3 * (MIN / stated) ** 0.5:.2g}")
    assert train["warmup_steps"] == round(0.05 * stated)

    # Before prepare, validate counts on the data file as init did; after it, on the dataset.
    checked = eyas(tmp_path, "validate", "run.toml")
    assert checked.returncode == 0 and "WARN" not in checked.stderr, checked.stderr
    assert f"train      ~{stated} optimizer steps: {train['epochs']} epochs × ~" in checked.stdout
    assert "estimated from " in checked.stdout
    (tmp_path / "run.toml").write_text(f'output_dir = "{tmp_path / "out"}"\n' + text)
    checked = eyas(tmp_path, "validate", "run.toml")
    counted = int(re.search(r"train +~(\d+) optimizer steps", checked.stdout).group(1))
    assert abs(counted - steps) <= max(1, 0.03 * steps), (counted, steps)
    assert f"{len(lengths)} training rows of ~{sum(lengths)} tokens, read from the prepared dataset in " in (
        checked.stdout
    )


def test_validate_warns_on_the_issues_three_step_config(tmp_path, target):
    """The config init wrote before it sized training (3 epochs of batch_tokens 8192 on 60 chats):
    valid, exit 0, and one WARN line with its steps and the keys to change."""
    _, _, text = init(tmp_path, target, 60)
    (tmp_path / "run.toml").write_text(with_train(text, epochs=3, batch_tokens=8192, lr="1e-4", warmup_steps=0))
    checked = eyas(tmp_path, "validate", "run.toml")
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith("run.toml: valid\n")
    warns = [line for line in checked.stderr.splitlines() if line.startswith("run.toml: WARN ")]
    assert len(warns) == 1, checked.stderr
    assert warns[0].startswith(
        "run.toml: WARN train: ~3 optimizer steps (3 epochs × ~1 of train.batch_tokens 8192 on 1 rank; "
    )
    assert f"fewer than the {MIN} a draft needs to learn; lower train.batch_tokens or raise train.epochs: " in warns[0]
    assert "train.batch_tokens = 1024, train.epochs = 20, train.lr = 0.001 and train.warmup_steps = " in warns[0]
    assert "the data is too small for a useful draft" in warns[0]
    # The 3 are the train stage's own count on the prepared data.
    _, steps = prepared_steps(tmp_path, tmp_path / "run.toml", tmp_path / "out")
    assert steps == 3
    (tmp_path / "run.toml").write_text(f'output_dir = "{tmp_path / "out"}"\n' + (tmp_path / "run.toml").read_text())
    again = eyas(tmp_path, "validate", "run.toml")
    assert again.returncode == 0
    assert "run.toml: WARN train: ~3 optimizer steps (3 epochs × ~1 of train.batch_tokens 8192 on 1 rank; " in (
        again.stderr
    )
    assert "read from the prepared dataset in " in again.stderr
