"""`eyas submit` and `eyas validate` refuse what they can see of a target without loading it (state/preload.py): no weights, an index naming a missing shard, a tensor-parallel size its heads do not allow; one line each, exit 2, and no run row nor run folder made. The daemon is real; the targets are config-only folders (tests/support/doctor_models.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from daemon_harness import EYAS, daemon  # noqa: F401 - the fixture
from doctor_models import make_weightless, write_run

from eyas.state import paths, queries

NO_WEIGHTS = (
    "holds no weights (no *.safetensors file), and extract (vllm) loads them; put the checkpoint's *.safetensors "
    'files (and its index) there, or, to run on random weights, set stages.extract.options.vllm.load_format = "dummy"'
)
MISSING_SHARD = (
    "names 2 shards, 1 of them missing (model-00002-of-00002.safetensors), and extract (vllm) loads them; "
    "finish downloading the checkpoint (every file the index names), or, to run on random weights, set "
    'stages.extract.options.vllm.load_format = "dummy"'
)
TP3 = "run.toml: extract.tensor_parallel_size: 3 does not divide num_attention_heads = 2; sizes that work: 1, 2"


def _run(root: Path, weights: str, tp: int, **keys) -> Path:
    target = make_weightless(root, None, weights=weights)
    return write_run(root, target, tp=tp, pipeline='["extract"]', devices='"cpu"', tokens=None, **keys)


def _eyas(daemon, *args: str, cwd: Path) -> subprocess.CompletedProcess:  # noqa: F811
    """The real command, against the test's daemon, from the run file's folder."""
    return subprocess.run([EYAS, *args], env=daemon.env, cwd=cwd, capture_output=True, text=True, timeout=120)


def _nothing_made(daemon, root: Path) -> None:  # noqa: F811
    db = daemon.reader()
    try:
        assert queries.list_runs(db.conn) == []
    finally:
        db.conn.close()
    runs = paths.runs_dir(daemon.home)
    assert not runs.exists() or list(runs.iterdir()) == []
    assert not (root / "out").exists()


CASES = {
    "no weights": ("none", 2, lambda t: [f"run.toml: target.path: {t} {NO_WEIGHTS}"]),
    "missing shard": (
        "index",
        2,
        lambda t: [f"run.toml: target.path: {t}/model.safetensors.index.json {MISSING_SHARD}"],
    ),
    "tp 3 on 2 heads": ("complete", 3, lambda t: [TP3]),
    "both": ("none", 3, lambda t: [f"run.toml: target.path: {t} {NO_WEIGHTS}", TP3]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_submit_and_validate_refuse_with_one_line_each_and_make_nothing(daemon, tmp_path, case):  # noqa: F811
    weights, tp, expected = CASES[case]
    run = _run(tmp_path, weights, tp)
    lines = expected(tmp_path / "tiny")
    out = _eyas(daemon, "submit", "run.toml", cwd=run.parent)
    assert (out.returncode, out.stdout) == (2, ""), out.stdout + out.stderr
    assert out.stderr.splitlines() == lines
    _nothing_made(daemon, tmp_path)
    checked = _eyas(daemon, "validate", "run.toml", cwd=run.parent)
    assert (checked.returncode, checked.stdout, checked.stderr.splitlines()) == (2, "", lines)


def test_the_dummy_weights_option_is_submitted(daemon, tmp_path):  # noqa: F811
    """With stages.extract.options.vllm.load_format = "dummy" the same weightless target is
    accepted: validate says so, submit queues the run (stopped here before its engine starts)."""
    run = _run(tmp_path, "none", 2, vllm_options={"load_format": "dummy"})
    checked = _eyas(daemon, "validate", "run.toml", cwd=run.parent)
    assert checked.returncode == 0, checked.stderr
    assert "  extract    vllm, tensor parallel 2, batch 8, dummy weights" in checked.stdout.splitlines()
    out = _eyas(daemon, "submit", "run.toml", cwd=run.parent)
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    assert out.stdout == "run 1 submitted: preflight → extract\n"
    assert daemon.cli("stop", "1").returncode == 0
    assert daemon.wait_run(1, timeout=60)["state"] == "cancelled"
