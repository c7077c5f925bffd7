"""[regenerate] and the regenerate stage in a run config (state/regenerate.py, state/runconfig.py, state/specs.py, state/preload.py): defaults, bad values refused in one line each, the stage's place in the pipeline, its engine options, its TP size and weights among what submit refuses, and the later stages' data directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas.state import preload
from eyas.state.regenerate import RegenerateConfig, data_dir
from eyas.state.runconfig import ConfigError, RunConfig, load, stage_options


def write(tmp_path: Path, pipeline: str, extra: str = "", vocab: int = 50000) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "num_hidden_layers": 4,
                "vocab_size": vocab,
                "hidden_size": 64,
                "num_attention_heads": 6,
                "num_key_value_heads": 6,
            }
        )
    )
    (model / "model.safetensors").write_bytes(b"x")
    (tmp_path / "chat.jsonl").write_text('{"messages": []}\n')
    path = tmp_path / "run.toml"
    path.write_text(
        f'name = "t"\npipeline = {pipeline}\n[target]\npath = "model"\n[data]\npath = "chat.jsonl"\n{extra}'
    )
    return path


def errors(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load(path)
    return [line.removeprefix(f"{path}: ") for line in str(err.value).splitlines()]


PIPELINE = '["prepare", "regenerate", "extract", "vocab", "train"]'


def test_defaults_greedy_and_the_stage_runs_after_prepare(tmp_path):
    cfg = load(write(tmp_path, PIPELINE))
    assert cfg.pipeline == ("preflight", "prepare", "regenerate", "extract", "vocab", "train")
    assert cfg.regenerate == RegenerateConfig()
    assert (cfg.regenerate.temperature, cfg.regenerate.top_p, cfg.regenerate.turns) == (0.0, 1.0, "all")
    assert RunConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert data_dir("/o", cfg.pipeline) == Path("/o/regenerate")
    text = '[regenerate]\ntemperature = 0.7\ntop_p = 0.9\nmax_tokens = 256\nseed = 3\nturns = "last"\nstop_token_ids = [7]\n'
    rg = load(write(tmp_path, PIPELINE, text)).regenerate
    assert (rg.temperature, rg.top_p, rg.max_tokens, rg.seed, rg.turns, rg.stop_token_ids) == (
        0.7,
        0.9,
        256,
        3,
        "last",
        (7,),
    )


def test_bad_values_and_a_misplaced_stage_are_one_line_each(tmp_path):
    text = '[regenerate]\ntemperature = -1\nturns = "first"\nstop_token_ids = [2, "x"]\nbatch = 3\n'
    assert errors(write(tmp_path, '["prepare", "extract", "regenerate", "train"]', text)) == [
        "regenerate.batch: unknown key; did you mean 'regenerate.batch_size'?",
        "regenerate.temperature: -1 is out of range; use a number >= 0 and <= 10",
        "regenerate.turns: unknown value 'first'; use one of: all, last",
        "regenerate.stop_token_ids: expected integers, got string 'x'",
        "pipeline: regenerate comes after extract, which reads its dataset; "
        'e.g. pipeline = ["preflight", "prepare", "regenerate", "extract", "train"]',
    ]


def test_engine_options_eyas_sets_are_refused_and_the_rest_pass(tmp_path):
    assert stage_options("regenerate", {"vllm": {"max_model_len": 64, "enforce_eager": False}}).vllm == {
        "max_model_len": 64,
        "enforce_eager": False,
    }
    with pytest.raises(ValueError, match=r"stages.regenerate.options.vllm: sets tensor_parallel_size, which eyas"):
        stage_options("regenerate", {"vllm": {"tensor_parallel_size": 2}})


def test_submit_refuses_its_tp_size_and_missing_weights_as_for_extract(tmp_path):
    # 6 heads: TP 4 does not divide them; regenerate's own size is told under its own key.
    cfg = load(write(tmp_path, PIPELINE, "[regenerate]\ntensor_parallel_size = 4\n"))
    assert [p.key for p in preload.problems(cfg)] == ["regenerate.tensor_parallel_size"]
    assert [(ld.stage, ld.engine) for ld in preload.loaders(cfg)] == [
        ("regenerate", "vllm"),
        ("extract", "transformers"),
        ("train", "speculators"),
    ]
    (tmp_path / "model" / "model.safetensors").unlink()
    weights = [p for p in preload.problems(cfg) if p.key == "target.path"]
    assert "regenerate (vllm), extract (transformers) and train (speculators) load them" in weights[0].problem
