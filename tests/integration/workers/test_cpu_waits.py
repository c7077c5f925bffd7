"""A CPU rank of extract (hf) or train loads torch with OpenMP's idle threads sleeping
(OMP_WAIT_POLICY=PASSIVE, workers/runtime/cpu_share.py: passive_waits), unless the environment
chose a policy: each stage runs in a fresh child process that records the policy at the moment
torch is first imported, which is when libgomp reads it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from train_pipeline import build_inputs, copy_inputs

pytestmark = pytest.mark.slow

SUPPORT = Path(__file__).resolve().parents[2] / "support"

CHILD = """
import importlib.abc, json, os, sys
from pathlib import Path

seen = {}

class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" and "policy" not in seen:
            seen["policy"] = os.environ.get("OMP_WAIT_POLICY", "unset")
        return None

sys.meta_path.insert(0, Watch())
sys.path.insert(0, sys.argv[1])
from train_pipeline import run_stage
from eyas.workers.stages import extract, train

stage, out, cfg = sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4])
run_stage({"extract": extract, "train": train}[stage], stage, out, cfg)
print("RESULT " + json.dumps(seen))
"""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("waits")
    base, cfg = build_inputs(root, rows=16)
    return root, base, cfg


def run_child(stage: str, out: Path, cfg: dict, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    environ.update(env)
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(SUPPORT), stage, str(out), json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))["policy"]


def test_extract_on_cpu_loads_torch_with_passive_waits(inputs):
    root, base, cfg = inputs
    out = root / "extract-only"
    shutil.copytree(base / "prepare", out / "prepare")
    assert run_child("extract", out, cfg) == "PASSIVE"
    assert len(list((out / "extract" / "hidden_states").glob("hs_*.safetensors"))) == 16


def test_train_on_cpu_loads_torch_with_passive_waits(inputs):
    root, base, cfg = inputs
    out = copy_inputs(base, root / "train-only")
    assert run_child("train", out, cfg) == "PASSIVE"
    assert (out / "train" / "checkpoints" / "epoch-2").is_dir()


def test_a_policy_the_environment_sets_is_kept(inputs):
    root, base, cfg = inputs
    out = copy_inputs(base, root / "train-active")
    assert run_child("train", out, cfg, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
