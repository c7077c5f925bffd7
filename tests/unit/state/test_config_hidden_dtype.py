"""[storage] hidden_dtype (state/drafttables.py): today's storage by default, "fp8" by choice, and a
bad value refused in one line naming the key and the choices; the extract stage's settings read it."""

from __future__ import annotations

from pathlib import Path

import pytest

from eyas.state.drafttables import HIDDEN_DTYPES, StorageConfig
from eyas.state.runconfig import ConfigError, RunConfig, load
from eyas.workers.extract.plan import Settings


def write(tmp_path: Path, storage: str = "") -> Path:
    path = tmp_path / "run.toml"
    path.write_text(f'name = "t"\npipeline = ["selftest"]\n{storage}')
    return path


def test_the_default_is_the_targets_dtype_as_before(tmp_path):
    assert HIDDEN_DTYPES == ("target", "fp8")
    cfg = load(write(tmp_path))
    assert cfg.storage.hidden_dtype == "target" == StorageConfig().hidden_dtype
    assert load(write(tmp_path, '[storage]\nhidden_dtype = "target"\n')).storage.hidden_dtype == "target"


def test_fp8_is_accepted_and_survives_the_round_trip_to_the_stage(tmp_path):
    cfg = load(write(tmp_path, '[storage]\nhidden_dtype = "fp8"\n'))
    assert cfg.storage.hidden_dtype == "fp8"
    back = RunConfig.from_dict(cfg.to_dict())
    assert back.storage.hidden_dtype == "fp8"
    d = {**cfg.to_dict(), "target": {"path": str(tmp_path), "dtype": "bfloat16"}, "resources": {"devices": "cpu"}}
    settings = Settings.from_config(d, {}, tmp_path, tmp_path / "extract")
    assert settings.hidden_dtype == "fp8"
    d.pop("storage")
    assert Settings.from_config(d, {}, tmp_path, tmp_path / "extract").hidden_dtype == "target"


@pytest.mark.parametrize(
    "value, line",
    [
        ('"bf16"', "storage.hidden_dtype: unknown value 'bf16'; use one of: target, fp8"),
        ('"fp_8"', "storage.hidden_dtype: unknown value 'fp_8'; did you mean 'fp8'? (one of: target, fp8)"),
        ("8", "storage.hidden_dtype: expected a string, got integer 8; use one of: target, fp8"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_key_and_the_choices(tmp_path, value, line):
    path = write(tmp_path, f"[storage]\nhidden_dtype = {value}\n")
    with pytest.raises(ConfigError) as err:
        load(path)
    assert str(err.value) == f"{path}: {line}"


def test_fp8_streams_too_and_reaches_the_extract_stage_so(tmp_path):
    """Streaming writes and reads fp8 shards (workers/extract/producer.py, train/feed.py): the
    pair is accepted, and the extract stage's settings carry both choices."""
    import json

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 512}
        )
    )
    (tmp_path / "chat.jsonl").write_text("")
    path = tmp_path / "run.toml"
    path.write_text(
        'name = "t"\npipeline = ["prepare", "extract", "vocab", "train"]\n'
        f'[target]\npath = "{model}"\n[data]\npath = "{tmp_path / "chat.jsonl"}"\n[draft]\nvocab_size = 256\n'
        '[storage]\nmode = "streaming"\nhidden_dtype = "fp8"\nbudget_gb = 1\n'
    )
    cfg = load(path)
    assert (cfg.storage.mode, cfg.storage.hidden_dtype, cfg.extract.backend) == ("streaming", "fp8", "hf")
    settings = Settings.from_config(
        {**cfg.to_dict(), "resources": {"devices": "cpu"}}, {}, tmp_path / "out", tmp_path / "out" / "extract"
    )
    assert (settings.hidden_dtype, settings.streaming) == ("fp8", True)
