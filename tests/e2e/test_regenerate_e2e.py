"""A pipeline that trains on the target's own answers, through a real daemon: preflight (with the generation's canary) -> prepare -> regenerate (vLLM's CPU build) -> extract (hf) -> vocab -> train, on a tiny chat-fitted llama; extract, vocab and train read the regenerated dataset, not prepare's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from daemon_harness import private_daemon
from regen_world import build_target, chats, columns, regen_toml
from safetensors.torch import load_file
from vllm_world import VLLM_ENV

from eyas.workers.data.target_vocab import target_vocab_size
from eyas.workers.stages.vocab import build_mapping

pytestmark = pytest.mark.slow

STAGES = ["prepare", "regenerate", "extract", "vocab", "train"]
ROWS = 16


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("regen-e2e")
    target, data = build_target(root), chats(root / "chat.jsonl", ROWS, seed=11)
    out = root / "out"
    toml = regen_toml(
        "regen-e2e",
        out,
        target,
        data,
        pipeline=STAGES,
        preflight=True,
        regenerate={"batch_size": 4},
        extract={"batch_size": 8},
        train={"epochs": 1, "lr": 1e-3, "batch_tokens": 512},
    )
    with private_daemon(grace=5.0, extra_env=VLLM_ENV) as d:
        run_id = d.submit(toml, "e2e.toml")
        run = d.wait_succeeded(run_id, timeout=540)
    return {"run": run, "out": out, "target": target}


def test_extract_vocab_and_train_read_the_regenerated_dataset(pipeline):
    run, out = pipeline["run"], pipeline["out"]
    stages = {s["name"]: s for s in run["stages"]}
    assert list(stages) == ["preflight", *STAGES]
    assert all(s["state"] == "succeeded" for s in stages.values())
    # The preflight ran the generation's canary on the shrunk, dummy-weight target.
    canary = stages["preflight"]["summary"]["generate_canary"]
    assert canary["prompts"] == 3 and all(1 <= a["tokens"] <= canary["max_tokens"] for a in canary["answers"])

    new, old = columns(out / "regenerate"), columns(out / "prepare")
    assert len(new["input_ids"]) == ROWS and new["input_ids"] != old["input_ids"]
    # extract: one file per regenerated row, holding that row's tokens (not prepare's).
    for i, ids in enumerate(new["input_ids"]):
        assert load_file(out / "extract" / "hidden_states" / f"hs_{i}.safetensors")["token_ids"].tolist() == ids
    assert stages["extract"]["summary"]["samples"] == ROWS
    # vocab: the mapping of the regenerated answers' token counts, which is not prepare's.
    v = target_vocab_size(pipeline["target"])
    want = build_mapping(np.load(out / "regenerate" / "token_freq.npy"), 256, v)
    assert not np.array_equal(want[0], build_mapping(np.load(out / "prepare" / "token_freq.npy"), 256, v)[0])
    assert np.array_equal(np.load(out / "vocab" / "d2t-256.npy"), want[0])
    # train: regenerate's split of the regenerated rows.
    split = json.loads((out / "regenerate" / "splits.json").read_text())
    tr = stages["train"]["summary"]
    assert (tr["train_rows"], tr["validation_rows"]) == (ROWS - len(split["validation"]), len(split["validation"]))
    assert split["source"] == "regenerate" and Path(tr["checkpoint"]).exists()
