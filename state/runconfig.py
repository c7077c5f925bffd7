"""The run configuration: one TOML file in, a frozen RunConfig out, or every mistake in it, one line each.

Each key's type, default and bounds are declared once, on the pydantic models of the tables
(state/inputtables.py: [target], [data]; state/drafttables.py: [extract], [draft], [train],
[evaluate], [storage]; state/executiontables.py: [resources], [slurm], [stages.<name>];
state/regenerate.py and state/tracking.py; the stages' options on their models in state/specs.py);
this module holds the top-level keys and RunConfig, which gathers the tables. `load()` reads the TOML and `validate()` checks it
table by table, translating pydantic's errors into the lines users read
(`<file>: <key>: <problem>; <fix>`, with a did-you-mean for misspelt keys and values), all at once,
so that a config is fixed in one round instead of one error per submit. Checks across tables and
against the filesystem (the target's config.json, the dataset, tensor parallelism against the
devices) run after the tables, between the values that passed their own checks. Workers get the
resolved config back as JSON (`RunConfig.to_dict()` / `RunConfig.from_dict()`).

No torch: the daemon and `eyas validate` import this module; what it reads of the target's
config.json is state/target.py's, with `json`, not transformers, for the same reason.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, ValidationInfo

from eyas.state import regenerate as regen
from eyas.state.drafttables import (
    DraftConfig,
    EvaluateConfig,
    ExtractConfig,
    StorageConfig,
    TrainConfig,
    check_evaluate,
)
from eyas.state.executiontables import ResourcesConfig, SlurmConfig, StageConfig, check_stages, no_options
from eyas.state.inputtables import DataConfig, TargetConfig, check_data, check_target
from eyas.state.regenerate import RegenerateConfig
from eyas.state.specs import DEFAULT_PIPELINE, STAGES, Table
from eyas.state.target import default_layer_ids, text_value
from eyas.state.tomlcheck import AbsPath, ConfigError, Report, describe, is_int, read_toml
from eyas.state.tracking import TrackingConfig

_NAME_CHARS = re.compile(r"[A-Za-z0-9._-]+")


# --- the value checks pydantic's declarations cannot say: each raises ValueError("problem; fix"),
# several problems of one value on several lines -------------------------------------------------


def _name(name: str) -> str:
    if not name:
        raise ValueError('empty; write a short name like "my-run"')
    if len(name) > 80:
        raise ValueError(f"{len(name)} characters is too long; use at most 80")
    if not _NAME_CHARS.fullmatch(name):
        fixed = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "my-run"
        raise ValueError(f"'{name}' may only hold letters, digits, '.', '_' and '-'; e.g. '{fixed}'")
    return name


def _pipeline_parts(value: Any) -> tuple[tuple[str, ...], list[str]]:
    """(the pipeline's known stages, each listed once; what is wrong with it): validation goes on
    with the stages it knows, so that the checks that depend on the pipeline still run."""
    if not isinstance(value, (list, tuple)):
        return DEFAULT_PIPELINE, [f"expected an array of stage names, got {describe(value)}"]
    problems = []
    if not value:
        problems.append(f"empty; list at least one stage, e.g. {json.dumps(list(DEFAULT_PIPELINE))}")
    names, out = list(STAGES), []
    for item in value:
        if not isinstance(item, str):
            problems.append(f"expected stage names, got {describe(item)}")
        elif item not in STAGES:
            close = difflib.get_close_matches(item, names, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"choose from {', '.join(names)}"
            problems.append(f"unknown stage '{item}'; {hint}")
        elif item in out:
            problems.append(f"'{item}' is listed twice; list each stage once")
        else:
            out.append(item)
    return tuple(out), problems


def _pipeline(value: Any) -> tuple[str, ...]:
    stages, problems = _pipeline_parts(value)
    if problems:
        raise ValueError("\n".join(problems))
    return stages


def _not_a_file(path: str, info: ValidationInfo) -> str:
    if (info.context or {}).get("base_dir") is not None and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} is a file; point it at a directory (it is created if missing)")
    return path


class _Head(Table):
    """The run's top-level keys, checked before its tables."""

    name: Annotated[str, AfterValidator(_name)] = Field(
        description="The run's name: at most 80 letters, digits, `.`, `_` and `-`.",
        json_schema_extra={"missing": 'add name = "my-run" at the top of the file'},
    )
    # Checked against the disk only when a file is.
    output_dir: Annotated[AbsPath, AfterValidator(_not_a_file)] | None = Field(
        None,
        description="Where the stages write their outputs, relative to this file; unset: the daemon picks "
        "`<state>/runs/<id>/out`.",
    )
    pipeline: Annotated[tuple[str, ...], BeforeValidator(_pipeline)] = Field(
        DEFAULT_PIPELINE,
        description="The stages to run, in order; `preflight` is put first when a stage reads the target "
        "(unless `preflight = false`), and `regenerate` may follow `prepare`.",
    )


class RunConfig(_Head):
    """A run: its top-level keys and one table per section; the sections' fields describe themselves."""

    target: TargetConfig | None = None
    data: DataConfig | None = None
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    draft: DraftConfig = Field(default_factory=DraftConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig)  # state/regenerate.py
    storage: StorageConfig = Field(default_factory=StorageConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)  # [tracking]: state/tracking.py
    stages: dict[str, StageConfig] = Field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only (tuples become lists); paths are already absolute."""
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        """Rebuild a config from `to_dict()`. Types only: the file system was checked when the run
        was submitted, and the paths may live on another host's view of it."""
        return cls.model_validate(d)


def stage_world_size(cfg: RunConfig, stage: str) -> int:
    """How many ranks the daemon starts for `stage`."""
    if not STAGES[stage].distributed:
        return 1
    override = cfg.stages.get(stage)
    if override is not None and override.ranks is not None:
        return override.ranks
    return cfg.resources.ranks


def stage_settings(cfg: RunConfig, stage: str) -> tuple[int, float, dict[str, Any]]:
    """(max_restarts, backoff seconds, options as written) of `stage`, defaults filled in."""
    sc = cfg.stages.get(stage) or StageConfig()
    restarts = STAGES[stage].max_restarts if sc.max_restarts is None else sc.max_restarts
    return restarts, sc.backoff, dict(sc.options)


def stage_options(stage: str, options: dict[str, Any]) -> Any:
    """`options` as the model of `stage`'s options (state/specs.py), defaults filled in: what the
    stage runs with. A submitted run's options were checked then; options handed to a stage
    directly raise ValueError, as the stage's other mistakes do: one `stages.<stage>.options.<key>: ...`
    line each."""
    report = Report(None)
    model = report.table(STAGES[stage].options, dict(options), f"stages.{stage}.options.", none_hint=no_options(stage))
    if report.errors:
        raise ValueError("\n".join(report.errors))
    return model


# --- validate: the tables in file order, then the checks across them --------------------------


def _with_preflight(report: Report, data: dict, pipeline: tuple[str, ...]) -> tuple[str, ...]:
    """The pipeline with "preflight" (eyas doctor's checks) first when any stage reads the target,
    unless the user placed it themselves or set `preflight = false`. Pipelines of stages that need
    no target (selftest) get none. `preflight` is read here only: RunConfig keeps no field for it."""
    wanted = data.get("preflight", True)
    if not isinstance(wanted, bool):
        report.error("preflight", f"expected true or false, got {describe(wanted)}")
        return pipeline
    if wanted is False and "preflight" in pipeline:
        report.error("preflight", 'false, but pipeline lists "preflight"; remove it from pipeline or drop this key')
    if not wanted or "preflight" in pipeline:
        return pipeline
    if any(STAGES[s].needs_target for s in pipeline):
        return ("preflight", *pipeline)
    return pipeline


def validate(data: dict[str, Any], base_dir: str | os.PathLike, source: str) -> RunConfig:
    """Check a parsed TOML document; raise ConfigError listing every mistake."""
    report = Report(source)
    files = {"base_dir": Path(base_dir).absolute()}  # the context that resolves and checks paths
    report.unknown_keys(data, "", [*RunConfig.model_fields, "preflight"])
    head = report.table(_Head, {k: v for k, v in data.items() if k in _Head.model_fields}, "", files)
    # The stages the pipeline names correctly, even when it has mistakes, so that the checks
    # that depend on it still run.
    pipeline = _pipeline_parts(data["pipeline"])[0] if "pipeline" in data else DEFAULT_PIPELINE
    target, model_cfg = check_target(report, data, pipeline, files)
    data_cfg = check_data(report, data, pipeline, files)
    pipeline = _with_preflight(report, data, pipeline)
    n_layers = text_value(model_cfg, "num_hidden_layers") if model_cfg else None

    extract = report.section(data, "extract", ExtractConfig, {"n_layers": n_layers}) or ExtractConfig()
    written = data["extract"] if isinstance(data.get("extract"), dict) else {}
    if "layer_ids" not in written and n_layers is not None:
        extract = extract.model_copy(update={"layer_ids": default_layer_ids(n_layers)})
    resources = report.section(data, "resources", ResourcesConfig) or ResourcesConfig()
    draft = report.section(data, "draft", DraftConfig) or DraftConfig()
    train = report.section(data, "train", TrainConfig) or TrainConfig()
    stages = check_stages(report, data, pipeline)
    storage = report.section(data, "storage", StorageConfig) or StorageConfig()
    slurm = report.section(data, "slurm", SlurmConfig) or SlurmConfig()
    if "slurm" in data and resources.executor != "slurm" and report.ok("resources.executor"):
        report.error("slurm", 'is read only by resources.executor = "slurm"; set that key or remove [slurm]')
    if storage.mode == "streaming" and not {"extract", "train"} <= set(pipeline):
        report.error("storage.mode", '"streaming" runs extract and train together; put both in the pipeline')
    if storage.mode == "streaming" and extract.backend == "vllm":
        extract_stage = stages.get("extract")
        ranks = extract_stage.ranks if extract_stage is not None and extract_stage.ranks else resources.ranks
        if ranks != 1:
            report.error(
                "storage.mode",
                f'"streaming" with extract.backend = "vllm" runs one driver rank, and extract would start {ranks}: '
                "set [stages.extract] ranks = 1 (its engine takes extract.tensor_parallel_size GPUs)",
            )

    # Checks across tables, only between values that passed their own checks (a rejected value
    # has been reported; its default must not raise a second, misleading error).
    tp = extract.tensor_parallel_size
    backend = extract.backend if report.ok("extract.backend") else None
    if tp > 1 and backend == "hf":
        report.error(
            "extract.tensor_parallel_size",
            f'{tp} needs backend "vllm"; set extract.backend = "vllm" or tensor_parallel_size = 1',
        )
    devices = resources.devices
    if isinstance(devices, tuple) and tp > len(devices) and backend == "vllm":
        report.error(
            "extract.tensor_parallel_size",
            f"{tp} needs {tp} GPUs but resources.devices lists "
            f"{len(devices)}; list {tp} devices or lower tensor_parallel_size",
        )
    target_vocab = text_value(model_cfg, "vocab_size") if model_cfg else None
    # The default draft vocab matters only to stages that build or train a draft.
    draft_written = data["draft"] if isinstance(data.get("draft"), dict) else {}
    uses_draft = {"vocab", "train", "evaluate"} & set(pipeline) or "vocab_size" in draft_written
    if uses_draft and is_int(target_vocab) and report.ok("draft.vocab_size") and draft.vocab_size > target_vocab:
        report.error(
            "draft.vocab_size",
            f"{draft.vocab_size} exceeds the target's vocabulary ({target_vocab}); use at most {target_vocab}",
        )
    evaluate = check_evaluate(
        report, data, pipeline, data_cfg, devices, files, tp if report.ok("extract.tensor_parallel_size") else 1
    )
    regenerate = regen.check(report, data, pipeline, devices)
    for problem in regen.pipeline_problems(pipeline):
        report.error("pipeline", problem)
    tracking = report.section(data, "tracking", TrackingConfig, files) or TrackingConfig()

    if report.errors:
        raise ConfigError(report.errors)
    return RunConfig(
        name=head.name,
        output_dir=head.output_dir,
        pipeline=pipeline,
        target=target,
        data=data_cfg,
        extract=extract,
        resources=resources,
        draft=draft,
        train=train,
        evaluate=evaluate,
        regenerate=regenerate,
        storage=storage,
        slurm=slurm,
        tracking=tracking,
        stages=stages,
    )


def load(path: str | os.PathLike) -> RunConfig:
    """Read and check a run's TOML file; relative paths in it count from its folder."""
    return validate(read_toml(path), Path(path).absolute().parent, os.fspath(path))
