"""The test and demo assets: built whole or not at all, rebuilt when built another way, and the
demo target's fitted output head (eyas.workers.models.assets.fit_to_chats)."""

from __future__ import annotations

import json
import math

import pytest
from safetensors.torch import load_file

from eyas.workers.models import assets

# Builds models and starts engines: `pytest -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return root, assets.build_all(root, fit_steps=40)


def test_the_fitted_head_predicts_the_chats_and_keeps_its_scale(built, tmp_path):
    root, made = built
    marker = json.loads((made["tiny-deepseek"] / assets.MARKER).read_text())
    assert {k: marker[k] for k in ("family", "seed", "fit_steps", "head_norm", "voice", "answers_only")} == {
        "family": "deepseek_v3",
        "seed": 0,
        "fit_steps": 40,
        "head_norm": assets.HEAD_NORM,
        # Its own voice (the chats' prompts answered otherwise), learnt on the answers' tokens.
        "voice": assets.voice_id("target"),
        "answers_only": True,
    }
    # Well below a uniform guess over the vocabulary: the head learnt the chats.
    vocab = json.loads((made["tiny-deepseek"] / "config.json").read_text())["vocab_size"]
    assert marker["final_loss"] < math.log(vocab) - 1.5
    fitted = load_file(made["tiny-deepseek"] / "model.safetensors")
    plain = load_file(assets.build_model(tmp_path / "plain", "deepseek_v3") / "model.safetensors")
    assert fitted["lm_head.weight"].norm(dim=1).mean().item() == pytest.approx(assets.HEAD_NORM, rel=1e-4)
    assert not fitted["lm_head.weight"].allclose(plain["lm_head.weight"])
    # Only the head moves; and vLLM still routes experts as transformers does.
    assert all(fitted[k].equal(plain[k]) for k in plain if not k.startswith("lm_head."))
    cfg = json.loads((made["tiny-deepseek"] / "config.json").read_text())
    assert (cfg["topk_method"], cfg["scoring_func"]) == ("noaux_tc", "sigmoid")
    # The llama target is never fitted.
    assert json.loads((made["tiny-llama"] / assets.MARKER).read_text())["fit_steps"] == 0


def test_a_second_build_keeps_what_is_there_and_rebuilds_what_was_built_otherwise(built):
    root, made = built
    stamp = {name: (made[name] / "model.safetensors").stat().st_mtime_ns for name in ("tiny-deepseek", "tiny-llama")}
    assert assets.build_all(root, fit_steps=40) == made
    assert {n: (made[n] / "model.safetensors").stat().st_mtime_ns for n in stamp} == stamp
    # An interrupted build (weights, no marker) does not count as built; nor does scratch left behind.
    (made["tiny-llama"] / assets.MARKER).unlink()
    (root / ".tiny-deepseek.partial").mkdir()
    assets.build_all(root, fit_steps=40)
    assert (made["tiny-llama"] / assets.MARKER).exists()
    assert (made["tiny-llama"] / "model.safetensors").stat().st_mtime_ns != stamp["tiny-llama"]
    assert (made["tiny-deepseek"] / "model.safetensors").stat().st_mtime_ns == stamp["tiny-deepseek"]
    assert not (root / ".tiny-deepseek.partial").exists()
    # A target fitted to a voice written otherwise (an older build's) is rebuilt.
    marker = made["tiny-deepseek"] / assets.MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "voice": "target 0123456789ab"}))
    assets.build_all(root, fit_steps=40)
    assert json.loads(marker.read_text())["voice"] == assets.voice_id("target")
    assert (made["tiny-deepseek"] / "model.safetensors").stat().st_mtime_ns != stamp["tiny-deepseek"]
    # Unfitted is another build: the random-weight target comes back.
    assets.build_all(root, fit_steps=0)
    assert json.loads((made["tiny-deepseek"] / assets.MARKER).read_text())["fit_steps"] == 0
    assert sorted(p.name for p in root.iterdir()) == ["chat.jsonl", "tiny-deepseek", "tiny-llama"]
