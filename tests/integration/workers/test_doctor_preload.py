"""`eyas doctor` and the preflight stage fail what `eyas submit` refuses of a target (state/preload.py), in its words: no weights, an index naming a missing shard, TP 3 on a target with 2 heads; and pass a weightless target whose run asks vLLM for dummy weights. The targets are config-only folders with a real tokenizer (tests/support/doctor_models.py); the preflight runs in a real daemon."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from daemon_harness import daemon  # noqa: F401 - the fixture
from doctor_models import EYAS, make_weightless, tokenizer_files, write_run  # noqa: F401 (tokenizer_files: fixture)

from eyas.state import runconfig as config
from eyas.workers.doctor import main as doctor

DUMMY_FIX = 'or, to run on random weights, set stages.extract.options.vllm.load_format = "dummy"'
NO_WEIGHTS = (
    "holds no weights (no *.safetensors file), and extract (vllm) loads them",
    f"put the checkpoint's *.safetensors files (and its index) there, {DUMMY_FIX}",
)
TP3 = (
    "extract.tensor_parallel_size: 3 does not divide num_attention_heads = 2",
    "sizes that work: 1, 2",
)


def _run(root: Path, tokenizer: Path, weights: str, tp: int, **keys) -> Path:
    target = make_weightless(root, tokenizer, weights=weights)
    return write_run(root, target, tp=tp, pipeline='["extract"]', devices='"cpu"', tokens=None, **keys)


def _failed(checks) -> list[tuple[str, str, str]]:
    return [(c.label, c.detail, c.fix) for c in checks if c.verdict == "fail"]


@pytest.mark.parametrize(
    "weights, tp, expected",
    [
        ("none", 2, lambda t: [("target: weights", f"target.path: {t} {NO_WEIGHTS[0]}", NO_WEIGHTS[1])]),
        (
            "index",
            2,
            lambda t: [
                (
                    "target: weights",
                    f"target.path: {t}/model.safetensors.index.json names 2 shards, 1 of them missing "
                    "(model-00002-of-00002.safetensors), and extract (vllm) loads them",
                    f"finish downloading the checkpoint (every file the index names), {DUMMY_FIX}",
                )
            ],
        ),
        ("complete", 3, lambda t: [("target: tensor parallel", *TP3)]),
    ],
    ids=["no weights", "missing shard", "tp 3 on 2 heads"],
)
def test_the_doctor_fails_what_submit_refuses_in_its_words(tmp_path, tokenizer_files, weights, tp, expected):
    run = _run(tmp_path, tokenizer_files, weights, tp)
    checks = doctor.diagnose(str(run))
    assert _failed(checks) == expected(tmp_path / "tiny")
    # Word for word the line `eyas submit` prints: "<file>: <key>: <problem>; <fix>".
    from eyas.state import preload

    ((_, detail, fix),) = _failed(checks)
    assert preload.lines(config.load(run), "run.toml") == [f"run.toml: {detail}; {fix}"]


def test_eyas_doctor_prints_both_fail_lines(tmp_path, tokenizer_files):
    run = _run(tmp_path, tokenizer_files, "none", 3)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "EYAS_FAKE_NVML": str(tmp_path / "nvml.json")}
    env.update({k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ})  # the test's own eyas
    (tmp_path / "nvml.json").write_text('{"devices": []}')
    proc = subprocess.run(
        [EYAS, "doctor", "run.toml"], cwd=run.parent, capture_output=True, text=True, env=env, timeout=180
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    width = max(len(line.split("  ")[1]) for line in lines[1:-1] if not line.startswith(" "))
    pad = " " * (6 + width + 2)
    target = tmp_path / "tiny"
    assert f"FAIL  {'target: weights'.ljust(width)}  target.path: {target} {NO_WEIGHTS[0]}" in lines
    assert f"{pad}fix: {NO_WEIGHTS[1]}" in lines
    assert f"FAIL  {'target: tensor parallel'.ljust(width)}  {TP3[0]}" in lines
    assert f"{pad}fix: {TP3[1]}" in lines
    assert lines[-1].endswith(", 2 failed")


def test_a_run_asking_for_dummy_weights_passes_the_weights_check(tmp_path, tokenizer_files):
    run = _run(tmp_path, tokenizer_files, "none", 2, vllm_options={"load_format": "dummy"})
    c = {x.label: x for x in doctor.diagnose(str(run))}
    assert _failed(c.values()) == []
    assert (c["target: weights"].verdict, c["target: weights"].detail) == (
        "pass",
        f"no complete safetensors weights in {tmp_path / 'tiny'}; not needed: extract runs on dummy weights "
        '(load_format = "dummy")',
    )
    assert (c["target: tensor parallel"].verdict, c["target: tensor parallel"].detail) == (
        "pass",
        "extract.tensor_parallel_size 2 fits num_attention_heads = 2",
    )


def test_the_preflight_fails_on_them_before_any_engine_starts(daemon, tmp_path, tokenizer_files):  # noqa: F811
    """Submitted past the CLI (a client of the socket), the run stops in its preflight, in
    seconds: the canary (vLLM at TP 3) never starts, nor does extract."""
    run = _run(tmp_path, tokenizer_files, "none", 3)
    run_id = daemon.submit(run.read_text())
    result = daemon.wait_run(run_id, timeout=120)
    assert result["state"] == "failed", daemon.diagnose(run_id)
    stages = {s["name"]: s for s in result["stages"]}
    assert (stages["preflight"]["state"], stages["extract"]["state"], stages["extract"]["attempt_list"]) == (
        "failed",
        "pending",
        [],
    )
    attempt = stages["preflight"]["attempt_list"][-1]
    root = attempt["root_cause"]
    assert root["type"] == "eyas.workers.stages.preflight.PreflightFailed"
    target = tmp_path / "tiny"
    assert root["message"] == (
        f"preflight: 2 checks failed: target: weights: target.path: {target} {NO_WEIGHTS[0]} (fix: {NO_WEIGHTS[1]}); "
        f"target: tensor parallel: {TP3[0]} (fix: {TP3[1]})"
    )
    summary = json.loads((Path(attempt["dir"]) / "summary.json").read_text())
    assert [c["name"] for c in summary["checks"] if c["verdict"] == "fail"] == ["weights", "tensor parallel"]
    assert "canary" not in summary and not (Path(attempt["dir"]) / "canary").exists()


@pytest.mark.slow
def test_a_weightless_target_extracts_on_dummy_weights_through_the_daemon(tmp_path, tokenizer_files):
    """The option is vLLM's own, passed through: `eyas submit` accepts the run, its preflight
    passes the weights check, and extract really runs vLLM on a target with no weight file."""
    from vllm_world import token_rows, vllm_daemon, write_dataset

    target = make_weightless(tmp_path, tokenizer_files)
    run = write_run(
        tmp_path,
        target,
        tp=1,
        pipeline='["extract"]',
        devices='"cpu"',
        tokens=None,
        dtype="float32",
        vllm_options={"load_format": "dummy"},
    )
    # No canary: the extract stage is what this test runs on dummy weights.
    run.write_text(run.read_text().replace("[extract]\n", "[extract]\ncanary = false\nbatch_size = 2\n", 1))
    lengths = [12, 7, 20]
    write_dataset(tmp_path / "out", token_rows(lengths, seed=3))
    (tmp_path / "ext").mkdir()
    with vllm_daemon(tmp_path / "ext") as d:
        out = subprocess.run([EYAS, "submit", str(run)], env=d.env, capture_output=True, text=True, timeout=120)
        assert (out.returncode, out.stdout) == (0, "run 1 submitted: preflight → extract\n"), out.stderr
        result = d.wait_run(1, timeout=600)
        assert result["state"] == "succeeded", d.diagnose(1)
        pre = {s["name"]: s for s in result["stages"]}["preflight"]["attempt_list"][-1]
        summary = json.loads((Path(pre["dir"]) / "summary.json").read_text())
        weights = [c for c in summary["checks"] if c["name"] == "weights"]
        assert [(c["verdict"], c["detail"]) for c in weights] == [
            (
                "pass",
                f"no complete safetensors weights in {target}; not needed: extract runs on dummy weights "
                '(load_format = "dummy")',
            )
        ]
    files = sorted((tmp_path / "out" / "extract" / "hidden_states").glob("hs_*.safetensors"))
    assert len(files) == len(lengths)
    assert not list(target.glob("*.safetensors"))  # still none: vLLM made its weights up
