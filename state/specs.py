"""What the daemon may know of the stages: one StageSpec each (name, entry point, launch defaults
and the pydantic model of its `[stages.<name>] options`), in the STAGES registry.

Pure data: the daemon and `eyas validate` import this module, so it must never pull in torch or
vLLM. The options models live here, beside the specs, so that a run's options are checked when it
is submitted (state/runconfig.py) rather than when the stage starts, hours into the run; the
stages then run with the same model (`runconfig.stage_options`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from eyas.state import contract


class Table(BaseModel):
    """A table of a run's TOML: frozen, unknown keys refused, TOML types taken as written
    (strict: `true` is no integer and "3" no number; an integer is a fine float)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


def _engine_args(fixed: tuple[str, ...], why: str) -> AfterValidator:
    """options.vllm: more vLLM engine arguments, none of those the stage sets itself."""

    def check(extra: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(k for k in extra if k in fixed)
        if taken:
            raise ValueError(
                f"sets {', '.join(taken)}, which eyas sets itself; remove {'it' if len(taken) == 1 else 'them'} ({why})"
            )
        return extra

    return AfterValidator(check)


# The engine arguments each stage sets itself: keep them in step with eyas.workers.vllm.backend.engine_args() and
# the engine arguments of workers/evaluate/engines.py.
EXTRACT_ENGINE_ARGS = (
    "model",
    "tokenizer",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "dtype",
    "enforce_eager",
    "enable_prefix_caching",
    "worker_extension_cls",
    "distributed_executor_backend",
    "skip_tokenizer_init",
    "trust_remote_code",
)
EVALUATE_ENGINE_ARGS = (
    "model",
    "tokenizer",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "dtype",
    "speculative_config",
    "skip_tokenizer_init",
    "trust_remote_code",
    "enable_prefix_caching",
    "disable_log_stats",
)


# The regenerate stage's (workers/vllm/generate.py): extract's, less what a generation may
# change: enforce_eager (CUDA graphs decode faster on GPUs) and enable_prefix_caching (faster
# multi-turn prompts, at the price of resumes that are byte-identical to an uninterrupted run).
REGENERATE_ENGINE_ARGS = tuple(a for a in EXTRACT_ENGINE_ARGS if a not in ("enforce_eager", "enable_prefix_caching"))


class NoOptions(Table):
    """The options of a stage that takes none: every key is unknown."""


def _class_name(name: str) -> str:
    module, _, cls = name.rpartition(".")
    if not (module and cls and all(part.isidentifier() for part in name.split("."))):
        raise ValueError(f"'{name}' is not a class name; name it as \"package.module.Class\"")
    return name


class ExtractOptions(Table):
    """[stages.extract] options (workers/stages/extract.py, workers/vllm/backend.py)."""

    vllm: (
        Annotated[
            dict[str, Any],
            _engine_args(
                EXTRACT_ENGINE_ARGS, "tensor_parallel_size: extract.tensor_parallel_size; dtype: target.dtype"
            ),
        ]
        | None
    ) = None
    # Another vLLM worker extension, a subclass of eyas's; imported (and checked) when the stage starts.
    worker_extension: Annotated[str, AfterValidator(_class_name)] | None = None


class TrainOptions(Table):
    """[stages.train] options (workers/stages/train.py); None: a default that depends on the device."""

    scheduler: Literal["linear", "cosine", "constant"] = "linear"  # speculators' default
    save_every: int = Field(0, ge=0)  # a mid-epoch checkpoint every N steps; 0: epoch ends only
    log_every: int = Field(1, ge=1)
    num_workers: int | None = Field(None, ge=0)  # 0 on CPU, 2 on CUDA
    loss: str = "kl_div"  # speculators' loss name, or JSON weights
    loss_implementation: Literal["eager", "fused"] | None = None  # fused on CUDA with triton, else eager
    attention: Literal["sdpa", "eager", "simple_flex_attention"] | None = None  # flex on CUDA, else sdpa
    ttt_step_loss_decay: float = 1.0


class EvaluateOptions(Table):
    """[stages.evaluate] options (workers/stages/evaluate.py)."""

    vllm: Annotated[
        dict[str, Any],
        _engine_args(
            EVALUATE_ENGINE_ARGS,
            "tensor_parallel_size: evaluate.tensor_parallel_size; dtype: target.dtype; "
            "speculative_config: evaluate.num_speculative_tokens",
        ),
    ] = Field(default_factory=dict)


class RegenerateOptions(Table):
    """[stages.regenerate] options (workers/stages/regenerate.py)."""

    vllm: Annotated[
        dict[str, Any],
        _engine_args(
            REGENERATE_ENGINE_ARGS, "tensor_parallel_size: regenerate.tensor_parallel_size; dtype: target.dtype"
        ),
    ] = Field(default_factory=dict)


# "tp-worker": the rank stands for a vLLM driver whose TP worker 1 raises (workers/stages/selftest.py).
FailMode = Literal["raise", "raise-empty", "exit", "segfault", "sigkill", "children", "hang", "tp-worker"]
GlooTeardown = Literal["naive", "safe"]
FAIL_MODES: tuple[str, ...] = get_args(FailMode)
GLOO_TEARDOWNS: tuple[str, ...] = get_args(GlooTeardown)


class SelftestOptions(Table):
    """[stages.selftest] options (workers/stages/selftest.py says what each does)."""

    steps: int = Field(10, ge=0)
    step_time: float = Field(0.05, ge=0)
    lines_per_sec: int = Field(0, ge=0)  # 0: one log line per step
    duration: float | None = Field(None, ge=0)  # with lines_per_sec: flood for this long (sets steps)
    tokens_per_step: int = 100
    fail: FailMode | None = None
    fail_rank: int = Field(0, ge=-1)  # -1: every rank
    fail_at_step: int = Field(0, ge=0)  # fail before doing this step (0-based)
    # TOML arrays arrive as lists: strict=False lets them become the tuple (the items stay strict).
    fail_attempts: tuple[int, ...] | None = Field(None, strict=False)  # None: on every attempt
    summary_on_fail: bool = False  # rank 0 writes summary.json before it fails (as evaluate does)
    heartbeat_for: float = Field(0.0, ge=0)  # first, this many seconds of silence but for heartbeats
    # What shows that phase working (workers/stages/selftest.py): "ticks", a counter in its
    # heartbeats; "child", a child process burning CPU (an engine's stand-in, to be stopped);
    # "none", nothing (a hung phase whose heartbeat thread still runs).
    heartbeat_evidence: Literal["ticks", "child", "none"] = "ticks"
    phase_budget: float | None = Field(None, gt=0)  # that phase's budget in seconds; None: none
    hang_at_end: bool = False  # after its steps, rank fail_rank (-1: all) blocks for ever, writing nothing
    linger_thread: bool = False  # after its work, leave a non-daemon thread that never ends
    ignore_sigterm: bool = False  # a rank that only SIGKILL ends (teardown waits out its grace)
    gloo_teardown: GlooTeardown | None = None  # a gloo group and a DDP model, torn down the old way or eyas's

    @model_validator(mode="after")
    def _flood_needs_rate_and_time(self) -> SelftestOptions:
        if self.duration is not None and self.lines_per_sec <= 0:
            raise ValueError("duration needs lines_per_sec > 0; set both, or neither")
        if self.step_time <= 0 and self.lines_per_sec > 0:
            raise ValueError("lines_per_sec needs step_time > 0; set step_time")
        return self


@dataclass(frozen=True)
class StageSpec:
    name: str
    entry: str  # "module:function" run by the rank runtime inside each rank
    description: str
    distributed: bool = True  # False: always one rank, whatever the run's ranks
    max_restarts: int = 0
    needs_target: bool = True  # the stage reads the target model
    needs_data: bool = False  # the stage reads the dataset
    gpus: bool = True  # False: runs on CPU (tokenizing, counting, checks) and holds no GPU
    # The hang bounds' defaults (README, "How it works → Hangs"); a run overrides them in
    # [stages.<name>], where 0 turns one off. Every legitimately silent phase of a real stage
    # (weight load, engine start-up, checkpoint save) shows evidence of its work (daemon/
    # phases.py), so ten minutes without any mean a hang, not a slow step.
    stall_timeout: float = 600.0  # seconds with no write and no phase evidence moving
    exit_timeout: float = 60.0  # seconds a rank may outlive its own work or its peers
    options: type[Table] = NoOptions  # the model [stages.<name>] options must fit


STAGES: dict[str, StageSpec] = {
    spec.name: spec
    for spec in (
        # `eyas doctor`'s checks, run first in every run that reads a target (runconfig.py puts it
        # there): a failed check stops the run before any rank group loads anything.
        StageSpec(
            "preflight",
            "eyas.workers.stages.preflight:main",
            "check versions, target, adapter, tokenizer and resources; run the engines' canaries",
            distributed=False,
            # The canaries' engines take extract's or regenerate's GPUs (daemon/scheduler.py: _devices_for).
            gpus=True,
        ),
        StageSpec(
            "prepare",
            "eyas.workers.stages.prepare:main",
            "render chats, build loss masks",
            distributed=False,
            needs_data=True,
            gpus=False,
        ),
        # The target answers the prepared prompts again; the later stages read its dataset
        # (state/regenerate.py: data_dir). Its engines take their GPUs as extract's do.
        StageSpec(
            "regenerate",
            "eyas.workers.stages.regenerate:main",
            "rewrite the assistant turns with the target (vLLM)",
            needs_data=True,
            options=RegenerateOptions,
        ),
        StageSpec(
            "extract", "eyas.workers.stages.extract:main", "capture the target's hidden states", options=ExtractOptions
        ),
        StageSpec(
            "vocab",
            "eyas.workers.stages.vocab:main",
            "build the draft vocabulary mapping",
            distributed=False,
            gpus=False,
        ),
        StageSpec("train", "eyas.workers.stages.train:main", "train the EAGLE-3 draft", options=TrainOptions),
        StageSpec(
            "evaluate",
            "eyas.workers.stages.evaluate:main",
            "measure acceptance in vLLM",
            distributed=False,
            options=EvaluateOptions,
        ),
        # A stage for tests and benchmarks: prints, reports progress, sleeps and fails on demand.
        # Its short stall default lets tests exercise the watchdog as a run gets it by default.
        StageSpec(
            "selftest",
            "eyas.workers.stages.selftest:main",
            "exercise the supervisor",
            needs_target=False,
            stall_timeout=20.0,
            options=SelftestOptions,
        ),
    )
}

# The pipeline a run gets when its config names none.
DEFAULT_PIPELINE = ("prepare", "extract", "vocab", "train", "evaluate")


def argv(python: str) -> list[str]:
    """The command line of one rank: the rank monitor, which runs the rank runtime."""
    return [python, "-m", contract.MONITOR_MODULE]


# --- the streaming pipeline ([storage] mode = "streaming", workers/extract/stream.py) ----------

# The two stages a streaming run starts together and supervises as one: either one's failure
# tears the other down, and a retry or a restart starts both.
STREAM_PAIR = ("extract", "train")
# What the teardown of the other half records as its cancel reason (daemon/settle.py reads it:
# such an attempt is a consequence, never a root cause, and never cancels the run).
SIBLING_TEARDOWN = "torn down with its streaming sibling: "


def streaming(cfg: dict) -> bool:
    """Whether a run (its config's dict form) streams extract into train."""
    return (cfg.get("storage") or {}).get("mode") == "streaming" and set(STREAM_PAIR) <= set(cfg.get("pipeline") or ())


def sibling(stage: str) -> str | None:
    """The other half of the streaming pair, or None for any other stage."""
    if stage not in STREAM_PAIR:
        return None
    return STREAM_PAIR[1 - STREAM_PAIR.index(stage)]


def stream_order(names: list[str]) -> list[str]:
    """The order a streaming run's stages start in: what reads only the dataset (vocab: prepare's
    or regenerate's) goes before extract, so that train can start beside extract."""
    if "extract" not in names or "vocab" not in names or names.index("vocab") < names.index("extract"):
        return list(names)
    rest = [n for n in names if n != "vocab"]
    rest.insert(rest.index("extract"), "vocab")
    return rest
