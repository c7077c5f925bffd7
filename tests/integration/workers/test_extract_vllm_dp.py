"""Data-parallel vLLM extraction (vLLM's CPU build, a real daemon): two ranks, each driving its own
engine over its share of the one batch plan, write exactly the files one engine writes, with the
hf backend's values; and a TP worker's exception in the engine of rank 1, whose files the daemon
does not watch, still comes back as the worker's own exception, never vLLM's flattened one.

This is the layout of a multi-node Slurm extraction (one engine per node, data parallel) on one
host: on CPU both engines share its cores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runtoml import extract_toml
from test_extract_vllm import ALL_IDS, LENGTHS, assert_matches, errors_of, hf_reference
from vllm_world import build_models, token_rows, vllm_daemon, write_dataset, write_extensions

from eyas.state.slurm import node_batches
from eyas.workers.extract.plan import plan_batches

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("vllm-dp-targets"))


# The seed's extension in the engine of driver rank 1 only: rank 0's engine works, so the
# failure is rank 1's own, in the engine whose TP files the daemon does not watch.
RANK1_EXT = """
import os

from seed_ext import Speculators030Worker
from eyas.workers.vllm.ext import EyasWorkerExtension

Rank1Seed = Speculators030Worker if os.environ.get("RANK") == "1" else EyasWorkerExtension
"""


@pytest.fixture(scope="module")
def vdaemon(tmp_path_factory):
    ext = write_extensions(tmp_path_factory.mktemp("vllm-dp-ext"))
    (ext / "rank1_seed_ext.py").write_text(RANK1_EXT)
    with vllm_daemon(ext) as d:
        yield d


def dp_toml(name: str, out: Path, target: Path, options: dict | None = None) -> str:
    return extract_toml(
        name, out, target, backend="vllm", ranks=2, tp=1, batch_size=4, layer_ids=ALL_IDS, options=options or {}
    )


def test_two_engines_split_the_plan_and_write_what_one_engine_writes(vdaemon, models, tmp_path):
    rows = token_rows(LENGTHS, seed=5)
    out = tmp_path / "dp"
    write_dataset(out, rows)
    run_id = vdaemon.submit(dp_toml("dp", out, models["llama"]), "dp.toml")
    run = vdaemon.wait_run(run_id, timeout=600)
    assert run["state"] == "succeeded", vdaemon.diagnose(run_id)
    want = hf_reference(tmp_path / "hf", models["llama"], rows)
    assert assert_matches(out / "extract" / "hidden_states", want, rows) < 1e-4
    attempt = Path(run["stages"][0]["attempt_list"][-1]["dir"])
    summary = json.loads((attempt / "summary.json").read_text())
    assert (summary["samples"], summary["files_written"], summary["engines"]) == (len(rows), len(rows), 2)
    # Each engine computed exactly its deal of the one plan, and the deals cover every row once.
    plan = plan_batches([len(r) for r in rows], 1, 0, 4)
    reports = [json.loads((attempt / f"rank-{r}.engine.json").read_text()) for r in (0, 1)]
    for r, report in enumerate(reports):
        mine = node_batches(plan, [len(x) for x in rows], r, 2)
        assert report["totals"][0] == sum(len(b) for b in mine) > 0
    assert reports[0]["totals"][0] + reports[1]["totals"][0] == len(rows)
    # Rank 1's TP worker kept its files in its own folder, not over rank 0's.
    assert (attempt / "driver-1" / "tp-0.proc.json").exists() and (attempt / "tp-0.proc.json").exists()


def test_a_tp_worker_error_in_rank_1s_engine_is_recorded_as_the_workers_exception(vdaemon, models, tmp_path):
    out = tmp_path / "seed"
    write_dataset(out, token_rows(LENGTHS[:8], seed=6))
    options = {"worker_extension": "rank1_seed_ext.Rank1Seed"}
    run_id = vdaemon.submit(dp_toml("seed-dp", out, models["deepseek_v3"], options), "seed-dp.toml")
    run = vdaemon.wait_run(run_id, timeout=600)
    assert run["state"] == "failed"
    attempt = run["stages"][0]["attempt_list"][-1]
    root = attempt["root_cause"]
    message = "'DeepseekV2Model' object has no attribute 'get_input_embeddings'"
    # Rank 1's own record, as its driver raised it: the worker's type, message and traceback.
    assert (root["type"], root["message"], root["rank"], root["role"]) == ("AttributeError", message, 1, None), root
    assert "patched_forward" in root["traceback"] and "get_input_embeddings(input_ids)" in root["traceback"]
    assert "raised in TP rank 0" in root["traceback"] and "of rank 1's vLLM engine" in root["traceback"]
    assert root["path"].endswith("rank-1.error.json")
    assert attempt["reason"] == f"rank 1 failed: AttributeError: {message}"
    # The worker's own file, in rank 1's folder, is where it came from.
    worker = json.loads((Path(attempt["dir"]) / "driver-1" / "tp-0.error.json").read_text())
    assert (worker["type"], worker["driver_rank"]) == ("AttributeError", 1)
    assert not [e for e in errors_of(vdaemon, run_id) if e["type"] == "RuntimeError" and e["root_cause"]]
