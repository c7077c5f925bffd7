"""[tracking] in a run config (state/tracking.py, hooked into state/runconfig.py): off by default, true for <output_dir>/tensorboard, a folder relative to the file, bad values refused in one line each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eyas.state.runconfig import ConfigError, RunConfig, load
from eyas.state.tracking import TrackingConfig, tensorboard_dir


def write(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "run.toml"
    path.write_text(f'name = "t"\npipeline = ["selftest"]\n{extra}')
    return path


def errors(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load(path)
    return [line.removeprefix(f"{path}: ") for line in str(err.value).splitlines()]


def test_off_by_default(tmp_path):
    cfg = load(write(tmp_path))
    assert cfg.tracking == TrackingConfig() and cfg.tracking.tensorboard is False
    assert tensorboard_dir(cfg.to_dict(), "/o") is None


def test_true_writes_under_the_output_dir_and_a_folder_counts_from_the_file(tmp_path):
    cfg = load(write(tmp_path, "[tracking]\ntensorboard = true\n"))
    assert tensorboard_dir(cfg.to_dict(), "/o") == Path("/o/tensorboard")
    cfg = load(write(tmp_path, '[tracking]\ntensorboard = "boards"\n'))
    assert cfg.tracking.tensorboard == str(tmp_path / "boards")
    # What the daemon reads back: the resolved config as JSON (config.json).
    again = RunConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and tensorboard_dir(again.to_dict(), "/o") == tmp_path / "boards"


def test_bad_values_are_one_line_each(tmp_path):
    (tmp_path / "afile").write_text("")
    assert errors(write(tmp_path, "[tracking]\ntensorboard = 1\nwandb = true\n")) == [
        "tracking.wandb: unknown key; valid keys: tensorboard",
        "tracking.tensorboard: expected true, false or a folder path, got integer 1",
    ]
    assert errors(write(tmp_path, '[tracking]\ntensorboard = "afile"\n')) == [
        f"tracking.tensorboard: {tmp_path / 'afile'} is a file; point it at a folder (it is created if missing)"
    ]
    assert errors(write(tmp_path, "tracking = 3\n")) == [
        "tracking: expected a table, got integer 3; write it as [tracking]"
    ]
