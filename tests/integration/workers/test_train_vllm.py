"""The trained draft works in vLLM: a checkpoint of the train stage, trained on the tiny Llama
target's hidden states, loads into vLLM's CPU build as an EAGLE-3 speculator and generates.

This proves the format, not the quality (acceptance belongs to the evaluate stage). The tiny
DeepseekV3 target is covered by tests/e2e/test_pipeline_e2e.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from train_pipeline import build_inputs, copy_inputs, run_stage, summary, vllm_generate

from eyas.workers.stages import train

# Builds models and starts engines: `pytest -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama_draft(tmp_path_factory):
    threads = torch.get_num_threads()
    env = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        root = tmp_path_factory.mktemp("vllm")
        base, cfg = build_inputs(root, family="llama")
        cfg = dict(cfg, train=dict(cfg["train"], epochs=1))
        out = copy_inputs(base, root / "out")
        ctx = run_stage(train, "train", out, cfg)
        return cfg["target"]["path"], summary(ctx)["checkpoint"]
    finally:
        torch.set_num_threads(threads)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env


def test_vllm_loads_the_trained_draft_as_an_eagle3_speculator_and_generates(llama_draft):
    target, draft = llama_draft
    assert json.loads(open(os.path.join(draft, "config.json")).read())["speculators_model_type"] == "eagle3"
    rc, result, out = vllm_generate(target, draft)
    assert rc == 0 and result is not None, out[-4000:]
    assert "Loading drafter model" in out
    assert [len(ids) for ids in result["token_ids"]] == [24, 24]  # greedy to max_tokens: no early stop
    m = result["metrics"]
    # The draft proposed tokens for the target to verify: speculative decoding really ran.
    assert m["vllm:spec_decode_num_drafts"] > 0
    assert m["vllm:spec_decode_num_draft_tokens"] == 3 * m["vllm:spec_decode_num_drafts"]
    assert 0 <= m["vllm:spec_decode_num_accepted_tokens"] <= m["vllm:spec_decode_num_draft_tokens"]
