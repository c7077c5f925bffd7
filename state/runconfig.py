"""The run configuration: one TOML file in, a frozen RunConfig out, or every mistake in it, one line each.

Each key's type, default and bounds are declared once, on the pydantic models below (the stages'
options on their models in state/specs.py). `load()` reads the TOML and `validate()` checks it
table by table, translating pydantic's errors into the lines users read
(`<file>: <key>: <problem>; <fix>`, with a did-you-mean for misspelt keys and values), all at once,
so that a config is fixed in one round instead of one error per submit. Checks across tables and
against the filesystem (the target's config.json, the dataset, tensor parallelism against the
devices) run after the tables, between the values that passed their own checks. Workers get the
resolved config back as JSON (`RunConfig.to_dict()` / `RunConfig.from_dict()`).

No torch: the daemon and `eyas validate` import this module; what it reads of the target's
config.json is state/target.py's, with `json`, not transformers, for the same reason.

Over 500 lines: the tables' models and validate(), which checks them and across them, are one
contract, read together.

Over 500 lines while issue 37 is open: it moves the per-table models into modules of their own (regenerate and tracking already are).
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BeforeValidator, Field, ValidationInfo

from eyas.state import regenerate as regen
from eyas.state.regenerate import RegenerateConfig
from eyas.state.specs import DEFAULT_PIPELINE, STAGES, Table
from eyas.state.target import default_layer_ids, layer_id_errors, num_hidden_layers, read_model_config, text_value
from eyas.state.tomlcheck import ConfigError, Report, describe, is_int, read_toml
from eyas.state.tracking import TrackingConfig

Dtype = Literal["float32", "float16", "bfloat16"]
DataFormat = Literal["auto", "sharegpt", "openai", "tokenized"]
Backend = Literal["hf", "vllm"]
Strategy = Literal["ddp", "fsdp"]
StorageMode = Literal["offline", "streaming"]
Executor = Literal["local", "slurm"]
HiddenDtype = Literal["target", "fp8"]
PhaseKind = Literal["load", "engine_start", "build", "checkpoint", "data", "wait", "other"]  # contract.PHASE_KINDS
DTYPES: tuple[str, ...] = get_args(Dtype)
DATA_FORMATS: tuple[str, ...] = get_args(DataFormat)
BACKENDS: tuple[str, ...] = get_args(Backend)
STRATEGIES: tuple[str, ...] = get_args(Strategy)
HIDDEN_DTYPES: tuple[str, ...] = get_args(HiddenDtype)
DEFAULT_BACKOFF = 2.0
LOG_MAX_MB = 512  # stages.<name>.log_max_mb's default; the daemon hands each rank its bound
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


def _path(value: Any, info: ValidationInfo) -> str:
    """An absolute path: a relative one counts from the TOML file's folder, the validation context's
    base_dir. Without one (from_dict, direct construction) the path is kept as given."""
    if not isinstance(value, str):
        raise ValueError(f"expected a path string, got {describe(value)}")
    if not value.strip():
        raise ValueError("empty; write a path, relative to this file's folder or absolute")
    base = (info.context or {}).get("base_dir")
    return os.path.normpath(base / Path(value).expanduser()) if base is not None else value


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


def _layer_ids(value: Any, info: ValidationInfo) -> Any:
    """Checked against the target's depth when validation knows it (context n_layers)."""
    if value is None:
        return None
    problems = layer_id_errors(value, (info.context or {}).get("n_layers"))
    if problems:
        raise ValueError("\n".join(problems))
    return tuple(value)


def _devices(value: Any) -> Any:
    fix = 'use "auto", "cpu" or a list of GPU indices like [0, 1]'
    if isinstance(value, str):
        if value in ("auto", "cpu"):
            return value
        raise ValueError(f"unknown value '{value}'; {fix}")
    if not isinstance(value, (list, tuple)):
        raise ValueError(f'expected "auto", "cpu" or a list of GPU indices, got {describe(value)}')
    if not value:
        raise ValueError(f"empty; {fix}")
    problems, seen = [], set()
    for d in value:
        if not is_int(d):
            problems.append(f"expected GPU indices (integers), got {describe(d)}")
        elif d < 0:
            problems.append(f"{d} is not a GPU index; use non-negative integers like [0, 1]")
        elif d in seen:
            problems.append(f"{d} is listed twice; list each GPU once")
        else:
            seen.add(d)
    if problems:
        raise ValueError("\n".join(problems))
    return tuple(value)


def _json_safe(options: dict[str, Any]) -> dict[str, Any]:
    try:
        json.dumps(options)  # the options reach the stage through the run's config JSON
    except TypeError:
        raise ValueError("holds a date or time, which cannot be passed to a stage; quote it as a string") from None
    return options


def _not_a_file(path: str, info: ValidationInfo) -> str:
    if (info.context or {}).get("base_dir") is not None and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} is a file; point it at a directory (it is created if missing)")
    return path


def _no_options(stage: str) -> str:
    return f"{stage} takes no options, so remove it"


AbsPath = Annotated[str, BeforeValidator(_path)]


# --- the models -------------------------------------------------------------------------------


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


class ExtractConfig(Table):
    """[extract]: which hidden states of the target are captured, and by which engine."""

    backend: Backend = Field(
        "hf",
        description="`hf`: transformers, data-parallel ranks; `vllm`: one vLLM engine per rank, "
        "each over `tensor_parallel_size` GPUs.",
    )
    # Resolved from the target's depth when the file names none (None only without a target).
    layer_ids: Annotated[tuple[int, ...] | None, BeforeValidator(_layer_ids)] = Field(
        None,
        description="Residual-stream ids to capture: id i is the input of layer i, id N the final pre-norm "
        "output; the last id is the verifier's hidden state, the others the draft's inputs. "
        "Unset: `[2, N//2, N-3, N]` from the target's depth N.",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM's tensor-parallel size per engine (1 with `hf`).")
    batch_size: int = Field(8, ge=1, description="Samples per forward.")
    # The preflight stage runs a shrunken, dummy-weight copy of this extraction first
    # (workers/canary/): the same backend, worker extension, TP size and model class.
    canary: bool = Field(
        True,
        description="Run the extraction's canary in preflight: the same engine, worker extension and model "
        "class on a shrunken, dummy-weight copy of the target, over two batches of the run's data.",
    )


class ResourcesConfig(Table):
    """[resources]: how many ranks a stage runs, on which devices, started by whom."""

    ranks: int = Field(
        1, ge=1, le=1024, description="Ranks of the distributed stages; `[stages.<name>] ranks` overrides it."
    )
    devices: Annotated[Literal["auto", "cpu"] | tuple[int, ...], BeforeValidator(_devices)] = Field(
        "auto",
        description='`"auto"`: the free GPUs NVML sees, else the CPU; `"cpu"`; or a list of GPU indices, '
        "e.g. `[0, 1]`.",
    )
    # Who starts the ranks: "local", the daemon on its own host; "slurm", one Slurm job per
    # attempt ([slurm], daemon/slurmgroup.py), its tasks on the nodes Slurm picks.
    executor: Executor = Field(
        "local",
        description="`local`: the daemon starts the ranks on its own host; `slurm`: each attempt is one "
        "Slurm job (see `[slurm]`).",
    )


def _sbatch_args(args: tuple[str, ...]) -> tuple[str, ...]:
    """[slurm] sbatch_args: sbatch options, none of those eyas writes itself."""
    fixed = ("--ntasks", "--job-name", "--output", "--error", "--chdir", "--parsable", "--requeue", "--wrap")
    for arg in args:
        if not arg.startswith("-"):
            raise ValueError(f'{arg!r} is not an sbatch option; write options like "--qos=high"')
        if arg.split("=", 1)[0] in fixed:
            raise ValueError(f"{arg!r}: eyas writes {arg.split('=', 1)[0]} itself; remove it")
    return args


class SlurmConfig(Table):
    """[slurm]: how a run with resources.executor = "slurm" asks Slurm for its nodes."""

    partition: str | None = Field(None, description="sbatch's `--partition`; unset: the cluster's default.")
    account: str | None = Field(None, description="sbatch's `--account`; unset: the cluster's default.")
    time_limit: str | None = Field(
        None, description="sbatch's `--time`, e.g. `\"2-00:00:00\"`; unset: the partition's limit."
    )
    nodes: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="sbatch's `--nodes`, never more than the stage's ranks (tasks spread evenly when they "
        "divide); unset: as many as Slurm needs for the ranks.",
    )
    gpus_per_node: int | None = Field(
        None, ge=0, le=64, description="sbatch's `--gpus-per-node`, asked only by the stages that use GPUs."
    )
    # TOML arrays arrive as lists: strict=False lets them become the tuple (the items stay strict).
    sbatch_args: Annotated[tuple[str, ...], AfterValidator(_sbatch_args)] = Field(
        (),
        strict=False,
        description='More sbatch options, e.g. `["--qos=high", "--exclusive"]`; those eyas writes itself '
        "(`--ntasks`, `--job-name`, `--output`, ...) are refused.",
    )
    # eyas doctor checks from a job step that every node sees the folder.
    state_dir: AbsPath | None = Field(
        None,
        description="Where the run's folder is made (its attempts' logs and records; its outputs unless "
        "`output_dir` says otherwise): a folder every node mounts at the same path. Unset: the daemon's "
        "state directory, which must then be shared.",
    )


class DraftConfig(Table):
    """[draft]: the shape of the EAGLE-3 draft."""

    vocab_size: int = Field(
        32000,
        ge=1,
        description="Draft vocabulary: the most frequent trainable tokens, at most the target's vocabulary.",
    )
    num_layers: int = Field(1, ge=1, le=8, description="Draft decoder layers.")
    ttt_steps: int = Field(3, ge=1, le=16, description="Test-time-training steps unrolled in each training step.")


class TrainConfig(Table):
    """[train]: the training schedule; `eyas init` sizes epochs, lr, batch_tokens and warmup_steps to the data."""

    epochs: int = Field(3, ge=1, description="Passes over the training rows.")
    lr: float = Field(1e-4, gt=0, lt=1, description="AdamW's peak learning rate, reached after the warmup.")
    batch_tokens: int = Field(
        8192, ge=16, description="Tokens packed per rank and optimizer step; a longer sample is cut to it."
    )
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of warmup before the decay.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="The gradients' largest norm; larger ones are clipped to it.")
    noise_std: float = Field(0.0, ge=0, description="Standard deviation of noise added to the hidden states; 0: none.")
    seed: int = Field(
        0,
        ge=0,
        le=2**32 - 1,  # numpy's seed range
        description="Seeds the draft's initial weights, the batches' shuffle and the noise: the same on every "
        "rank and every retry.",
    )
    strategy: Strategy = Field("ddp", description="How the ranks share training: `ddp` or `fsdp`.")


class EvaluateConfig(Table):
    """[evaluate]: the draft's acceptance in vLLM (workers/stages/evaluate.py)."""

    num_speculative_tokens: int = Field(3, ge=1, le=16, description="k: the draft tokens proposed per target forward.")
    # How many prompts and answer tokens: enough to tell two drafts apart. The acceptance
    # length's 95 % interval narrows as 1/sqrt(prompts): measured with the demo's draft on its
    # chats' turns at 128 tokens, +-0.16 on 128 prompts, +-0.12 on 256, +-0.09 on 512. More
    # tokens per prompt barely narrow it (256 prompts: +-0.128 at 64 tokens, +-0.124 at 128): the
    # spread is between prompts, not within one. 256 prompts x 128 tokens: drafts 0.2 apart
    # tell apart, in a few minutes of GPU time per engine.
    max_tokens: int = Field(128, ge=1, le=65536, description="Greedy tokens generated per prompt.")
    max_prompts: int = Field(256, ge=0, description="Evaluate on the first N prompts; 0: all of them.")
    prompts: AbsPath | None = Field(
        None,
        description='A JSONL file of prompts (`{"prompt": ...}`, `{"prompt_token_ids": [...]}` or chats), '
        "relative to this file; unset: prepare's validation rows, one prompt per assistant turn.",
    )
    batch_size: int = Field(16, ge=1, le=4096, description="Sequences vLLM runs at once (`max_num_seqs`).")
    # None only before validation: it then defaults to extract.tensor_parallel_size.
    tensor_parallel_size: int | None = Field(
        None, ge=1, description="vLLM's tensor-parallel size for the three engines; unset: extract's."
    )
    # 0.1: the demo gains 0.37 (95 % interval 0.25 to 0.61); a draft that adds a tenth of a token
    # per target forward or less learned nothing worth serving.
    min_gain: float = Field(
        0.1,
        ge=0,
        description="The quality gate: the least gain in acceptance length over the untrained draft, on the "
        "same prompts; a draft below it fails the stage (its figures recorded first, never restarted). 0: off.",
    )


class StorageConfig(Table):
    """[storage]: how extract's hidden states reach train (workers/extract/stream.py)."""

    mode: StorageMode = Field(
        "offline",
        description="`offline`: extract writes every hidden state, then train reads them; `streaming`: "
        "extract and train run at once, train reading shards as they land, inside a disk budget.",
    )
    budget_gb: float | None = Field(
        None,
        gt=0,
        description="Streaming's bound on the hidden states' disk in GB (1e9 bytes); unset: `budget_fraction`.",
    )
    budget_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="With `budget_gb` unset: this fraction of the free space when extract first starts.",
    )
    # workers/extract/hsformat.py writes and reads both layouts.
    hidden_dtype: HiddenDtype = Field(
        "target",
        description="`target`: the target's dtype, speculators' own format; `fp8`: float8 e4m3 with a "
        "power-of-two scale per token and layer, about half the bytes, read by eyas's trainer and "
        "speculators' fp8 backend only.",
    )


class StageConfig(Table):
    """[stages.<name>]: one stage's supervision (restarts, hang bounds, log bound), ranks and options."""

    max_restarts: int | None = Field(
        None, ge=0, le=100, description="Automatic new attempts after a failure; unset: the stage's default, 0."
    )
    backoff: float = Field(DEFAULT_BACKOFF, ge=0, description="Seconds before the first restart, doubled each time.")
    # The hang bounds (daemon/watchdog.py); None takes the stage spec's default.
    stall_timeout: float | None = Field(
        None,
        ge=0,
        description="Seconds with no sign of life (a log line, a progress record, a long phase's evidence "
        "moving), or with a process under a rank stopped or in disk wait, before the attempt fails as "
        "`Stalled`; unset: 600 (selftest: 20); 0: off.",
    )
    exit_timeout: float | None = Field(
        None,
        ge=0,
        description="Seconds a rank may stay alive after its stage function returned, or after every other "
        "rank exited 0, before the attempt fails as `Straggler`; unset: 60; 0: off.",
    )
    # daemon/phases.py; the keys are state/contract.py's PHASE_KINDS.
    phase_budgets: dict[PhaseKind, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict,
        description="The most seconds a long silent phase of a kind may take, over the budget the rank "
        "derives from its work (weight bytes at 50 MB/s plus 10 minutes; an engine start adds 20); past it "
        "the attempt fails as `Stalled`. 0: no budget.",
    )
    # state/logcut.py cuts the log; the daemon hands each rank its bound as EYAS_LOG_MAX_MB.
    log_max_mb: float = Field(
        LOG_MAX_MB,
        ge=0,
        description="Each rank log's bound in MiB (vLLM's split `tp-<k>.log` and `driver.log` too): past it "
        "the log keeps its first 10 %, one marker line and the output since. 0: unbounded.",
    )
    ranks: int | None = Field(
        None, ge=1, description="This stage's world size; unset: `resources.ranks`. Distributed stages only."
    )
    # As written: validate() checks them against the stage's options model (STAGES[name].options).
    options: Annotated[dict[str, Any], AfterValidator(_json_safe)] = Field(
        default_factory=dict,
        description="The stage's own options (extract, regenerate, train, evaluate, selftest; the others take "
        "none), checked with the rest of the file: see the stage options below.",
    )


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
    model = report.table(STAGES[stage].options, dict(options), f"stages.{stage}.options.", none_hint=_no_options(stage))
    if report.errors:
        raise ValueError("\n".join(report.errors))
    return model


# --- validate: the tables in file order, then the checks across them --------------------------


def _section(report: Report, data: dict, key: str, model: type[Table], context: dict | None = None) -> Any:
    """The table `key` of the file as a `model`; None when absent, not a table, or unusable."""
    if key not in data:
        return None
    if not isinstance(data[key], dict):
        report.error(key, f"expected a table, got {describe(data[key])}; write it as [{key}]")
        return None
    return report.table(model, data[key], f"{key}.", context)


def _stages_phrase(stages: list[str]) -> str:
    """'stage prepare reads' / 'stages extract, train read'."""
    if len(stages) == 1:
        return f"stage {stages[0]} reads"
    return f"stages {', '.join(stages)} read"


def _check_target(report: Report, data: dict, pipeline: tuple[str, ...], context: dict):
    """(TargetConfig | None, the target's config.json dict | None)."""
    readers = [s for s in pipeline if STAGES[s].needs_target]
    if "target" not in data and readers:
        report.error(
            "target",
            f"missing ({_stages_phrase(readers)} the target model); "
            'add a [target] table with path = "<model directory>"',
        )
    target = _section(report, data, "target", TargetConfig, context)
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


def _check_data(report: Report, data: dict, pipeline: tuple[str, ...], context: dict) -> DataConfig | None:
    readers = [s for s in pipeline if STAGES[s].needs_data]
    if "data" not in data and readers:
        report.error(
            "data",
            f"missing ({_stages_phrase(readers)} the dataset); "
            'add a [data] table with path = "<chat .jsonl file or directory>"',
        )
    cfg = _section(report, data, "data", DataConfig, context)
    if cfg is not None and not os.path.exists(cfg.path):
        report.error("data.path", f"{cfg.path} does not exist; point it at a .jsonl file or a directory")
    return cfg


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


def _check_stages(report: Report, data: dict, pipeline: tuple[str, ...]) -> dict[str, StageConfig]:
    if "stages" not in data:
        return {}
    table = data["stages"]
    if not isinstance(table, dict):
        report.error("stages", f"expected a table, got {describe(table)}; write [stages.<name>] tables")
        return {}
    out = {}
    for name, sub in table.items():
        key = f"stages.{name}"
        if name not in pipeline:
            if name in STAGES:
                report.error(key, f"'{name}' is not in the pipeline; add it to pipeline or remove [{key}]")
            else:
                close = difflib.get_close_matches(name, list(pipeline), n=1)
                hint = (
                    f"did you mean 'stages.{close[0]}'?"
                    if close
                    else f"the pipeline's stages are: {', '.join(pipeline)}"
                )
                report.error(key, f"unknown stage; {hint}")
            continue
        if not isinstance(sub, dict):
            report.error(key, f"expected a table, got {describe(sub)}; write it as [{key}]")
            continue
        stage = report.table(StageConfig, sub, f"{key}.")
        if "ranks" in sub and not STAGES[name].distributed:
            report.error(f"{key}.ranks", f"{name} always runs as one rank; remove this key")
            stage = stage.model_copy(update={"ranks": None})
        # The stage's own options, now rather than when the stage starts (a rejected options
        # table was reported above and left empty).
        report.table(STAGES[name].options, stage.options, f"{key}.options.", none_hint=_no_options(name))
        out[name] = stage
    return out


def validate(data: dict[str, Any], base_dir: str | os.PathLike, source: str) -> RunConfig:
    """Check a parsed TOML document; raise ConfigError listing every mistake."""
    report = Report(source)
    files = {"base_dir": Path(base_dir).absolute()}  # the context that resolves and checks paths
    report.unknown_keys(data, "", [*RunConfig.model_fields, "preflight"])
    head = report.table(_Head, {k: v for k, v in data.items() if k in _Head.model_fields}, "", files)
    # The stages the pipeline names correctly, even when it has mistakes, so that the checks
    # that depend on it still run.
    pipeline = _pipeline_parts(data["pipeline"])[0] if "pipeline" in data else DEFAULT_PIPELINE
    target, model_cfg = _check_target(report, data, pipeline, files)
    data_cfg = _check_data(report, data, pipeline, files)
    pipeline = _with_preflight(report, data, pipeline)
    n_layers = text_value(model_cfg, "num_hidden_layers") if model_cfg else None

    extract = _section(report, data, "extract", ExtractConfig, {"n_layers": n_layers}) or ExtractConfig()
    written = data["extract"] if isinstance(data.get("extract"), dict) else {}
    if "layer_ids" not in written and n_layers is not None:
        extract = extract.model_copy(update={"layer_ids": default_layer_ids(n_layers)})
    resources = _section(report, data, "resources", ResourcesConfig) or ResourcesConfig()
    draft = _section(report, data, "draft", DraftConfig) or DraftConfig()
    train = _section(report, data, "train", TrainConfig) or TrainConfig()
    stages = _check_stages(report, data, pipeline)
    storage = _section(report, data, "storage", StorageConfig) or StorageConfig()
    slurm = _section(report, data, "slurm", SlurmConfig) or SlurmConfig()
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
    evaluate = _check_evaluate(
        report, data, pipeline, data_cfg, devices, files, tp if report.ok("extract.tensor_parallel_size") else 1
    )
    regenerate = regen.check(report, data, pipeline, devices)
    for problem in regen.pipeline_problems(pipeline):
        report.error("pipeline", problem)
    tracking = _section(report, data, "tracking", TrackingConfig, files) or TrackingConfig()

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


def _check_evaluate(
    report: Report,
    data: dict,
    pipeline: tuple[str, ...],
    data_cfg: DataConfig | None,
    devices: Any,
    files: dict,
    extract_tp: int,
) -> EvaluateConfig:
    """[evaluate], with tensor_parallel_size defaulting to the run's (extract's) TP size."""
    ev = _section(report, data, "evaluate", EvaluateConfig, files) or EvaluateConfig()
    written = data["evaluate"] if isinstance(data.get("evaluate"), dict) else {}
    if ev.prompts is not None and not os.path.isfile(ev.prompts):
        what = "is a directory" if os.path.isdir(ev.prompts) else "does not exist"
        report.error(
            "evaluate.prompts",
            f"{ev.prompts} {what}; point it at a JSONL file of prompts, or remove "
            "the key to prompt with prepare's validation rows",
        )
    elif (
        ev.prompts is None
        and "prompts" not in written
        and "evaluate" in pipeline
        and data_cfg is not None
        and data_cfg.validation_fraction == 0
    ):
        report.error(
            "evaluate.prompts",
            "missing, and data.validation_fraction = 0 holds no rows out to prompt "
            "with; set data.validation_fraction > 0 or evaluate.prompts to a JSONL "
            "prompt file",
        )
    # A default taken from extract was checked there (it can exceed the devices only with backend
    # "vllm", which reports it); only a size set here is checked here.
    if ev.tensor_parallel_size is None:
        return ev.model_copy(update={"tensor_parallel_size": extract_tp})
    tp = ev.tensor_parallel_size
    if "evaluate" in pipeline and isinstance(devices, tuple) and tp > len(devices):
        report.error(
            "evaluate.tensor_parallel_size",
            f"{tp} needs {tp} GPUs but resources.devices lists {len(devices)}; list {tp} devices or lower it",
        )
    return ev


def load(path: str | os.PathLike) -> RunConfig:
    """Read and check a run's TOML file; relative paths in it count from its folder."""
    return validate(read_toml(path), Path(path).absolute().parent, os.fspath(path))
