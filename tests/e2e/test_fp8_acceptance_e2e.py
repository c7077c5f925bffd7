"""[storage] hidden_dtype = "fp8" through the whole pipeline and a real daemon: the draft trained on
fp8 hidden states is accepted in vLLM (the evaluate stage's acceptance length) within 0.03 of the
draft trained on the same run's default states, and extract wrote fp8 files of about half the size."""

from __future__ import annotations

from pathlib import Path

import pytest
from daemon_harness import private_daemon
from runtoml import run_toml

from eyas.workers.models import assets

# Builds models, trains and starts vLLM twice (several minutes): `pytest -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow

STAGES = ["prepare", "extract", "vocab", "train", "evaluate"]


def pipeline_toml(name: str, target: Path, data: Path, hidden_dtype: str) -> str:
    # tests/e2e/test_pipeline_e2e.py's run on one rank; only [storage] differs between the two.
    return run_toml(
        name,
        STAGES,
        preflight=False,
        target={"path": target, "dtype": "float32"},
        data={"path": data, "max_length": 128, "limit": 80, "validation_fraction": 0.15},
        extract={"batch_size": 8},
        resources={"ranks": 1, "devices": "cpu"},
        draft={"vocab_size": 256},
        train={"epochs": 2, "lr": 1e-3, "batch_tokens": 512},
        # The quality gate off, as in test_pipeline_e2e.py: this short training gains little, and
        # what is compared here is the two runs' acceptance, whatever it is.
        evaluate={"max_tokens": 32, "min_gain": 0},
        storage={"hidden_dtype": hidden_dtype},
        stages={stage: {"stall_timeout": 180} for stage in STAGES},
    )


@pytest.fixture(scope="module")
def daemon():
    with private_daemon() as d:
        yield d


@pytest.mark.timeout(1800)
def test_the_fp8_runs_acceptance_is_within_003_of_the_default_runs(daemon):
    made = assets.build_all(daemon.home / "assets")
    runs = {
        dtype: daemon.wait_succeeded(
            daemon.submit(
                pipeline_toml(f"e2e-{dtype}", made["tiny-deepseek"], made["chat.jsonl"], dtype), f"{dtype}.toml"
            ),
            timeout=900,
        )
        for dtype in ("target", "fp8")
    }
    ev = {d: {s["name"]: s for s in r["stages"]}["evaluate"]["summary"] for d, r in runs.items()}
    ex = {d: {s["name"]: s for s in r["stages"]}["extract"]["summary"] for d, r in runs.items()}
    sizes = {
        d: sum(p.stat().st_size for p in (Path(r["output_dir"]) / "extract" / "hidden_states").glob("hs_*.safetensors"))
        for d, r in runs.items()
    }
    print(
        f"acceptance length: default {ev['target']['acceptance_length']:.4f}, fp8 {ev['fp8']['acceptance_length']:.4f} "
        f"(baseline {ev['target']['baseline_acceptance_length']:.4f}); hidden states: default (float32) "
        f"{sizes['target']} B, fp8 {sizes['fp8']} B"
    )
    assert (ex["target"]["hidden_dtype"], ex["fp8"]["hidden_dtype"]) == ("target", "fp8")
    for d in runs:
        assert ev[d]["lossless"] and ev[d]["trained"]["drafts"] > 0, d
        # Training did something: the trained draft beats the untrained one it started from.
        assert ev[d]["acceptance_length"] > ev[d]["baseline_acceptance_length"], d
    assert ev["fp8"]["acceptance_length"] == pytest.approx(ev["target"]["acceptance_length"], abs=0.03)
    # float32 on CPU: 4 bytes a value against fp8's one, plus the per-file costs.
    assert sizes["fp8"] < 0.3 * sizes["target"]
