"""`eyas doctor --canary` on a run that regenerates: the generation's canary (workers/canary/generate.py) is a check of the canary group beside the extraction's, passing on a tiny llama at TP 1 and naming vLLM's refusal of a target whose architecture it cannot load."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from regen_world import chats, regen_toml
from vllm_world import VLLM_ENV

from eyas.workers.models import assets

pytestmark = pytest.mark.slow

EYAS = str(Path(sys.executable).parent / "eyas")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor-gen")
    return {"target": assets.build_model(root / "llama", "llama"), "data": chats(root / "chat.jsonl", 6)}


def doctor(cfg: Path) -> tuple[int, list[dict], str]:
    env = {**os.environ, **VLLM_ENV}
    env.pop("EYAS_ATTEMPT_DIR", None)  # outside a run, as a user types it
    proc = subprocess.run(
        [EYAS, "doctor", str(cfg), "--canary", "--json"], capture_output=True, text=True, env=env, timeout=400
    )
    return proc.returncode, json.loads(proc.stdout)["checks"], proc.stdout[-3000:] + proc.stderr[-3000:]


def test_doctor_canary_runs_the_generation_canary_of_a_run_that_regenerates(world, tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text(regen_toml("doc-gen", tmp_path / "out", world["target"], world["data"]))
    code, checks, output = doctor(cfg)
    assert code == 0, output
    found = {c["name"]: c for c in checks if c["group"] == "canary"}
    assert list(found) == ["extraction path", "generation path"]
    assert found["extraction path"]["detail"] == "not run: the pipeline has no extract stage"
    gen = found["generation path"]
    assert gen["verdict"] == "pass", gen
    assert re.fullmatch(
        r"vllm at TP 1, dummy weights, \d+ of 8 layers: 3 of 3 prompts answered "
        r"\(\d+ tokens, [0-3] at a stop token\), answers checked, \d+\.\d s",
        gen["detail"],
    ), gen["detail"]
    report = gen["data"]
    assert (report["tensor_parallel_size"], report["prompts"], report["layers"][0]) == (1, 3, 8)
    assert all(1 <= a["tokens"] <= report["max_tokens"] for a in report["answers"])
    assert "as prepare renders them" in report["data"]  # the run's own chats, rendered as prepare will


def test_doctor_generation_canary_names_what_vllm_refuses(world, tmp_path):
    """A target whose architecture this vLLM has no class for: no static check reads vLLM's
    registry for a run without extract, so the generation canary is what fails, with vLLM's
    own words and the fix."""
    target = tmp_path / "odd"
    shutil.copytree(world["target"], target)
    cfg_path = target / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    cfg_json["architectures"] = ["EyasUnknownForCausalLM"]
    cfg_path.write_text(json.dumps(cfg_json, indent=2))
    cfg = tmp_path / "run.toml"
    cfg.write_text(regen_toml("doc-gen-odd", tmp_path / "out", target, world["data"]))
    code, checks, output = doctor(cfg)
    assert code == 1, output
    assert [c["name"] for c in checks if c["verdict"] == "fail"] == ["generation path"], output
    gen = next(c for c in checks if c["name"] == "generation path")
    assert gen["group"] == "canary"
    # vLLM's own words, not pydantic's count of errors; the list of every supported architecture
    # that follows them is left to --json.
    assert gen["detail"] == (
        "ValidationError: Model architectures ['EyasUnknownForCausalLM'] are not supported for now. "
        "(the whole message is in --json)"
    ), gen["detail"]
    assert gen["fix"].startswith("the run's regenerate stage fails the same way once the target has loaded: fix ")
    assert "an architecture this vLLM loads" in gen["fix"]
    assert "Supported architectures: " in gen["data"]["traceback"]
