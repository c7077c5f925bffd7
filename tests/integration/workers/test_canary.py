"""The extraction canary (workers/canary/run.py) in the preflight stage and in `eyas doctor --canary`: the seed's bug caught before any full engine load, a sound run passing, and what the canary checks of its captures.

The daemon tests run vLLM's CPU build at TP 2 with the seed's worker extension (speculators
0.3.0's patched forward, tests/support/vllm_world.py) on the tiny DeepseekV3 target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from runtoml import run_toml
from safetensors.torch import save_file
from vllm_world import VLLM_ENV, build_models, token_rows, vllm_daemon, write_dataset, write_extensions

from eyas.state import runconfig
from eyas.workers.canary import run as canary

pytestmark = pytest.mark.slow

EYAS = str(Path(sys.executable).parent / "eyas")
SEED_EXT = "seed_ext.Speculators030Worker"
LENGTHS = [44, 9, 71, 26, 58, 13, 35, 80, 19, 50]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("canary-targets"))


@pytest.fixture(scope="module")
def ext_dir(tmp_path_factory):
    return write_extensions(tmp_path_factory.mktemp("canary-ext"))


@pytest.fixture(scope="module")
def vdaemon(ext_dir):
    """A real daemon whose ranks find the test extensions and keep vLLM's CPU cache small."""
    with vllm_daemon(ext_dir) as d:
        yield d


def extract_run(name: str, out: Path, target: Path, tp: int, extension: str | None = None, backend="vllm") -> str:
    """An extract run with the preflight on (the default), on CPU, the layer ids left to eyas."""
    return run_toml(
        name,
        ["extract"],
        output_dir=out,
        target={"path": target, "dtype": "float32"},
        resources={"ranks": 1, "devices": "cpu"},
        extract={"backend": backend, "tensor_parallel_size": tp, "batch_size": 4},
        draft={"vocab_size": 256},
        stages={"extract": {"options": {"worker_extension": extension}}} if extension else None,
    )


def test_the_seeds_bug_fails_in_the_preflight_canary_before_any_full_load(vdaemon, models, tmp_path):
    out = tmp_path / "seed"
    write_dataset(out, token_rows(LENGTHS, seed=4))
    t0 = time.monotonic()
    run_id = vdaemon.submit(extract_run("seed-canary", out, models["deepseek_v3"], 2, SEED_EXT), "seed.toml")
    run = vdaemon.wait_run(run_id, timeout=240)
    elapsed = time.monotonic() - t0
    print(f"\nseed's bug: submit -> failed in preflight in {elapsed:.1f} s")
    assert run["state"] == "failed", run
    stages = {s["name"]: s for s in run["stages"]}
    assert stages["preflight"]["state"] == "failed"
    assert stages["extract"]["attempt_list"] == [] and stages["extract"]["state"] == "pending"
    assert not (out / "extract").exists()  # the real extraction never started
    attempt = stages["preflight"]["attempt_list"][-1]
    root = attempt["root_cause"]
    assert root["type"] == "AttributeError"
    assert root["message"] == "'DeepseekV2Model' object has no attribute 'get_input_embeddings'"
    assert root["role"] == "tp-worker" and root["tp_rank"] in (0, 1) and root["rank"] == 1 + root["tp_rank"]
    assert "get_input_embeddings(input_ids)" in root["traceback"] and "patched_forward" in root["traceback"]
    assert run["reason"] == (
        f"preflight: TP rank {root['tp_rank']} failed: AttributeError: 'DeepseekV2Model' object has "
        "no attribute 'get_input_embeddings'"
    )
    log = Path(attempt["dir"], "rank-0.log").read_text()
    # The canary ran the run's own extension on the shrunken copy, with dummy weights.
    assert "canary: vllm backend at TP 2, seed_ext.Speculators030Worker, dummy weights; 4 of 8 layers" in log
    # The time is printed, not asserted: a test is no benchmark, and a loaded machine stretches
    # it (36.5 s alone on 2 cores, 96 s beside a full test run). That the full load never
    # started is asserted above, from the record and the output folder.


def test_a_sound_run_passes_the_canary_then_extracts(vdaemon, models, tmp_path):
    out = tmp_path / "ok"
    rows = token_rows(LENGTHS, seed=4)
    write_dataset(out, rows)
    run_id = vdaemon.submit(extract_run("ok-canary", out, models["deepseek_v3"], 2), "ok.toml")
    run = vdaemon.wait_run(run_id, timeout=400)
    assert run["state"] == "succeeded", run
    pre = {s["name"]: s for s in run["stages"]}["preflight"]["attempt_list"][-1]
    report = json.loads(Path(pre["dir"], "summary.json").read_text())["canary"]
    assert report["backend"] == "vllm" and report["tensor_parallel_size"] == 2
    assert report["layers"] == [8, 4]
    assert report["layer_ids"]["run"] == [2, 4, 5, 8] and report["layer_ids"]["canary"] == [1, 2, 3, 4]
    assert report["decoder_class"] == "DeepseekV2Model" and report["model_class"] == "DeepseekV3ForCausalLM"
    assert report["samples"] == 8 and report["batches"] == 2
    assert report["tokens"] == sum(LENGTHS[:7]) + LENGTHS[0] // 2
    assert report["data"].startswith("the first 7 rows of the prepared dataset")
    assert report["hidden_size"] == json.loads((models["deepseek_v3"] / "config.json").read_text())["hidden_size"]
    assert report["twin_max_abs_diff"] <= canary.TWIN_TOLERANCE
    assert not Path(pre["dir"], "canary", "hidden_states").exists()  # the canary's files are gone
    assert len(list((out / "extract" / "hidden_states").glob("hs_*.safetensors"))) == len(rows)


def test_doctor_canary_names_the_workers_error(models, ext_dir, tmp_path):
    out = tmp_path / "doc"
    write_dataset(out, token_rows(LENGTHS[:4], seed=7))
    cfg = tmp_path / "run.toml"
    cfg.write_text(extract_run("doc", out, models["deepseek_v3"], 1, SEED_EXT))
    env = {
        **os.environ,
        **VLLM_ENV,
        "PYTHONPATH": os.pathsep.join([str(ext_dir), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("EYAS_ATTEMPT_DIR", None)
    proc = subprocess.run(
        [EYAS, "doctor", str(cfg), "--canary", "--json"], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = json.loads(proc.stdout)["checks"]
    # The static checks cannot see what the extension does (some may warn, e.g. on CPU); only the
    # canary fails, and it names the worker's own error.
    assert [c["group"] for c in checks if c["verdict"] == "fail"] == ["canary"]
    found = [c for c in checks if c["group"] == "canary"]
    assert len(found) == 1 and found[0]["verdict"] == "fail"
    assert found[0]["detail"] == (
        "TP worker 0: AttributeError: 'DeepseekV2Model' object has no attribute 'get_input_embeddings'"
    )
    assert "patched_forward" in found[0]["data"]["traceback"]
    assert "fix the worker extension" in found[0]["fix"]


def test_hf_canary_reports_the_mapping_and_checks_its_captures(models, tmp_path):
    out = tmp_path / "hf"
    rows = token_rows([30, 12, 7, 21, 16], seed=9)
    write_dataset(out, rows)
    cfg = runconfig.RunConfig.model_validate(
        {
            "name": "hf",
            "pipeline": ["extract"],
            "target": {"path": str(models["llama"]), "dtype": "float32"},
            "extract": {"backend": "hf", "batch_size": 2, "layer_ids": [1, 3, 6, 8]},
            "resources": {"devices": "cpu"},
        }
    )
    report = canary.run(cfg, out, tmp_path / "work")
    assert report["layers"] == [8, 4] and report["layer_ids"]["canary"] == [1, 2, 3, 4]
    assert report["model_class"] == "LlamaForCausalLM"
    assert report["samples"] == 4  # 2 batches of 2: three rows and the prefix twin
    assert report["tokens"] == 30 + 12 + 7 + 15
    assert report["twin_max_abs_diff"] < 1e-4  # float32, same weights: causal attention
    assert not (tmp_path / "work" / "hidden_states").exists()


def test_verify_refuses_a_mis_sliced_capture(tmp_path):
    rows = [[5, 6, 7, 8], [9, 10], [5, 6]]
    states = torch.randn(4, 2, 3)
    save_file({"hidden_states": states, "token_ids": torch.tensor(rows[0])}, tmp_path / "hs_0.safetensors")
    save_file(
        {"hidden_states": torch.randn(2, 2, 3), "token_ids": torch.tensor(rows[1])}, tmp_path / "hs_1.safetensors"
    )
    save_file({"hidden_states": states[:2].clone(), "token_ids": torch.tensor(rows[2])}, tmp_path / "hs_2.safetensors")
    assert canary.verify(tmp_path, rows, 2, 3, "float32") == 0.0
    # The twin carrying another request's states: what a mis-sliced step writes.
    save_file({"hidden_states": states[2:].clone(), "token_ids": torch.tensor(rows[2])}, tmp_path / "hs_2.safetensors")
    with pytest.raises(canary.CanaryFailed, match="per-request slicing: sample 2"):
        canary.verify(tmp_path, rows, 2, 3, "float32")
    with pytest.raises(canary.CanaryFailed, match=r"hs_0.safetensors: hidden_states of shape \(4, 2, 3\), expected"):
        canary.verify(tmp_path, rows, 3, 3, "float32")
    with pytest.raises(canary.CanaryFailed, match="hidden_states in torch.float32, the run's dtype is bfloat16"):
        canary.verify(tmp_path, rows, 2, 3, "bfloat16")
    with pytest.raises(canary.CanaryFailed, match="token_ids are not sample 1's"):
        canary.verify(tmp_path, [rows[0], [9, 11], rows[2]], 2, 3, "float32")
