"""The run config's tables of where and how a run's stages run: `[resources]`, `[slurm]` and `[stages.<name>]` (ranks, devices, executor, the daemon's supervision, each stage's options), each key declared once.

`check_stages()` is validate()'s (state/runconfig.py) check of the `[stages.<name>]` tables against
the pipeline and of each stage's options against its model in state/specs.py.
"""

from __future__ import annotations

import difflib
import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field

from eyas.state.specs import STAGES, Table
from eyas.state.tomlcheck import AbsPath, Report, describe, is_int

Executor = Literal["local", "slurm"]
PhaseKind = Literal["load", "engine_start", "build", "checkpoint", "data", "wait", "other"]  # contract.PHASE_KINDS
DEFAULT_BACKOFF = 2.0
LOG_MAX_MB = 512  # stages.<name>.log_max_mb's default; the daemon hands each rank its bound


# The value checks pydantic's declarations cannot say: each raises ValueError("problem; fix").


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


def no_options(stage: str) -> str:
    return f"{stage} takes no options, so remove it"


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


def check_stages(report: Report, data: dict, pipeline: tuple[str, ...]) -> dict[str, StageConfig]:
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
        report.table(STAGES[name].options, stage.options, f"{key}.options.", none_hint=no_options(name))
        out[name] = stage
    return out
