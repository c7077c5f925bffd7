"""The run config's `[target]` and `[data]` tables: what a run reads, each key declared once, and the checks of both against the disk and the pipeline.

`check_target()` and `check_data()` are validate()'s (state/runconfig.py): a table a pipeline's
stages need is required, its path must exist, and the target's config.json must be readable
(with `json`, state/target.py, not transformers: the daemon and `eyas validate` import this).
"""

from __future__ import annotations

import os
from typing import Literal, get_args

from pydantic import Field

from eyas.state.specs import STAGES, Table
from eyas.state.target import num_hidden_layers, read_model_config
from eyas.state.tomlcheck import AbsPath, Report

Dtype = Literal["float32", "float16", "bfloat16"]
DataFormat = Literal["auto", "sharegpt", "openai", "tokenized"]
DTYPES: tuple[str, ...] = get_args(Dtype)
DATA_FORMATS: tuple[str, ...] = get_args(DataFormat)


class TargetConfig(Table):
    """[target]: the model the draft is trained for."""

    path: AbsPath = Field(
        description="The target's model directory (`config.json`, and the `*.safetensors` files for the stages "
        "that load weights), relative to this file; required when a stage reads the target.",
        json_schema_extra={"missing": "set it to the target model's directory (the one with config.json)"},
    )
    dtype: Dtype = Field("bfloat16", description="The dtype the target is loaded in, and its hidden states'.")
    trust_remote_code: bool = Field(False, description="Allow the model's own code (an `auto_map` in config.json).")


class DataConfig(Table):
    """[data]: the chats prepare reads."""

    path: AbsPath = Field(
        description="A JSON or JSONL file, or a directory of them, relative to this file; required by prepare.",
        json_schema_extra={"missing": "set it to the dataset (a .jsonl file or a directory)"},
    )
    format: DataFormat = Field(
        "auto",
        description="`sharegpt` (`conversations` of `from`/`value`), `openai` (`messages`, system turns "
        "included) or `tokenized` (`input_ids` + `loss_mask`); `auto` tells them apart by the rows.",
    )
    max_length: int = Field(2048, ge=16, le=1_048_576, description="Tokens per sample after truncation.")
    limit: int = Field(0, ge=0, description="Read at most this many rows; 0: all of them.")
    validation_fraction: float = Field(
        0.05, ge=0, lt=1, description="The share of rows held out for validation (and evaluate's default prompts)."
    )


def _stages_phrase(stages: list[str]) -> str:
    """'stage prepare reads' / 'stages extract, train read'."""
    if len(stages) == 1:
        return f"stage {stages[0]} reads"
    return f"stages {', '.join(stages)} read"


def check_target(report: Report, data: dict, pipeline: tuple[str, ...], context: dict):
    """(TargetConfig | None, the target's config.json dict | None)."""
    readers = [s for s in pipeline if STAGES[s].needs_target]
    if "target" not in data and readers:
        report.error(
            "target",
            f"missing ({_stages_phrase(readers)} the target model); "
            'add a [target] table with path = "<model directory>"',
        )
    target = report.section(data, "target", TargetConfig, context)
    if target is None:
        return None, None
    path, fix = target.path, "point it at a model directory with config.json"
    if not os.path.exists(path):
        report.error("target.path", f"{path} does not exist; {fix}")
    elif not os.path.isdir(path):
        report.error("target.path", f"{path} is not a directory; {fix}")
    elif not os.path.isfile(os.path.join(path, "config.json")):
        report.error("target.path", f"{path} has no config.json; {fix}")
    else:
        try:
            model_cfg = read_model_config(path)
            num_hidden_layers(path)
        except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
            report.error("target.path", f"{path}/config.json is unusable ({exc}); {fix}")
        else:
            return target, model_cfg
    return target, None


def check_data(report: Report, data: dict, pipeline: tuple[str, ...], context: dict) -> DataConfig | None:
    readers = [s for s in pipeline if STAGES[s].needs_data]
    if "data" not in data and readers:
        report.error(
            "data",
            f"missing ({_stages_phrase(readers)} the dataset); "
            'add a [data] table with path = "<chat .jsonl file or directory>"',
        )
    cfg = report.section(data, "data", DataConfig, context)
    if cfg is not None and not os.path.exists(cfg.path):
        report.error("data.path", f"{cfg.path} does not exist; point it at a .jsonl file or a directory")
    return cfg
