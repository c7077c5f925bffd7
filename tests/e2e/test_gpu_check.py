"""`tests/gpu/check.sh --cpu`: the prepared device check, rehearsed on CPU with tiny shapes, passes
and reports real figures for both architectures, so the script the GPU machine runs cannot rot."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
from daemon_harness import short_tmp

# Builds models and starts engines: `pytest -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "tests" / "gpu" / "check.sh"


@pytest.mark.timeout(1800)
def test_the_device_check_passes_on_cpu_with_real_figures():
    out = short_tmp()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(out / "rt"), "COLUMNS": "200"}
    env.pop("EYAS_HOME", None)  # the check runs its own daemon under <out>/home
    proc = subprocess.run(
        [str(CHECK), "--cpu", "--out", str(out)], capture_output=True, text=True, env=env, timeout=1700
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    report = json.loads((out / "check.json").read_text())
    assert report["ok"] is True and report["failures"] == []
    assert report["profile"]["name"] == "cpu"
    assert sorted(report["models"]) == ["deepseek_v3", "llama"]
    for family, m in report["models"].items():
        # Both backends captured every layer id the run chose, and agree to float32 rounding,
        # on hidden states that are not all zero.
        assert m["layer_ids"] and sorted(m["diff"]) == sorted(str(i) for i in m["layer_ids"]), family
        for layer, d in m["diff"].items():
            assert d["ok"] and d["max_abs_diff"] <= 1e-3, (family, layer, d)
            assert d["max_abs"] > 0.1, (family, layer, d)
        # The same tokens went through extraction and the prefill-only baseline.
        assert m["extract"]["tokens"] == m["generate"]["tokens"] > 0
        assert m["extract"]["tok_s"] > 0 and m["generate"]["tok_s"] > 0 and m["extract"]["hf_tok_s"] > 0
        assert math.isclose(m["ratio"], m["extract"]["tok_s"] / m["generate"]["tok_s"], rel_tol=1e-9)
        tr = m["train"]
        assert tr["steps"] >= 20 and math.isfinite(tr["loss"]), tr
        assert tr["val_loss"] < tr["val_loss_initial"] / 2, tr  # the draft learned the target's answers
        ev = m["evaluate"]
        assert ev["lossless"] is True, ev
        assert ev["acceptance_length"] >= 1.0 and ev["baseline_acceptance_length"] >= 1.0, ev
    # The one table names both targets and ends with where the figures are.
    assert "deepseek_v3" in proc.stdout and "llama" in proc.stdout
    assert f"figures in {out / 'check.json'}" in proc.stdout.replace("\n", "")
