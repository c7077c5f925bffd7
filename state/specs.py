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


# The engine arguments each stage sets itself: keep them in step with eyas.workers.vllm.engine.engine_args() and
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
    """[stages.extract] options: the vLLM engine's arguments and worker extension (workers/stages/extract.py, workers/vllm/engine.py)."""

    vllm: (
        Annotated[
            dict[str, Any],
            _engine_args(
                EXTRACT_ENGINE_ARGS, "tensor_parallel_size: extract.tensor_parallel_size; dtype: target.dtype"
            ),
        ]
        | None
    ) = Field(
        None,
        description='More vLLM engine arguments for `backend = "vllm"`, e.g. `{ gpu_memory_utilization = 0.8 }` '
        'or `{ load_format = "dummy" }` (random weights, for rehearsals); not those eyas sets itself.',
    )
    # Imported (and checked) when the stage starts, not at submit: the daemon loads no vLLM.
    worker_extension: Annotated[str, AfterValidator(_class_name)] | None = Field(
        None,
        description='Another vLLM worker extension, `"package.module.Class"`, a subclass of eyas\'s.',
    )


class TrainOptions(Table):
    """[stages.train] options: the training loop's finer settings (workers/stages/train.py); unset ones default by device."""

    scheduler: Literal["linear", "cosine", "constant"] = Field(
        "linear", description="The learning rate's decay after the warmup (linear: speculators' default)."
    )
    save_every: int = Field(0, ge=0, description="A mid-epoch checkpoint every N steps; 0: at epoch ends only.")
    log_every: int = Field(1, ge=1, description="Record the training figures every N steps.")
    num_workers: int | None = Field(None, ge=0, description="Data-loader worker processes; unset: 0 on CPU, 2 on CUDA.")
    loss: str = Field("kl_div", description="speculators' loss name, or its per-loss weights as JSON.")
    loss_implementation: Literal["eager", "fused"] | None = Field(
        None, description="The loss kernel; unset: `fused` on CUDA with triton, else `eager`."
    )
    attention: Literal["sdpa", "eager", "simple_flex_attention"] | None = Field(
        None, description="The draft's attention; unset: flex attention on CUDA, else `sdpa`."
    )
    ttt_step_loss_decay: float = Field(
        1.0,
        description="The loss weight's decay per test-time-training step, as a factor (1: every step weighs the same).",
    )


class EvaluateOptions(Table):
    """[stages.evaluate] options: the vLLM engines' arguments (workers/stages/evaluate.py)."""

    vllm: Annotated[
        dict[str, Any],
        _engine_args(
            EVALUATE_ENGINE_ARGS,
            "tensor_parallel_size: evaluate.tensor_parallel_size; dtype: target.dtype; "
            "speculative_config: evaluate.num_speculative_tokens",
        ),
    ] = Field(
        default_factory=dict,
        description="More vLLM engine arguments for the three engines, e.g. `{ gpu_memory_utilization = 0.8 }`; "
        "not those eyas sets itself.",
    )


class RegenerateOptions(Table):
    """[stages.regenerate] options: the vLLM engines' arguments (workers/stages/regenerate.py)."""

    vllm: Annotated[
        dict[str, Any],
        _engine_args(
            REGENERATE_ENGINE_ARGS, "tensor_parallel_size: regenerate.tensor_parallel_size; dtype: target.dtype"
        ),
    ] = Field(
        default_factory=dict,
        description="More vLLM engine arguments: `max_model_len` (default `data.max_length`, within the "
        "target's `max_position_embeddings`); `enforce_eager` (on by default on the CPU build only); "
        "`enable_prefix_caching` (off by default: a batch's answers would depend on the batches before it, "
        "and a resumed run would no longer be byte-identical).",
    )


# "tp-worker": the rank stands for a vLLM driver whose TP worker 1 raises (workers/stages/selftest.py).
FailMode = Literal["raise", "raise-empty", "exit", "segfault", "sigkill", "children", "hang", "tp-worker"]
GlooTeardown = Literal["naive", "safe"]
FAIL_MODES: tuple[str, ...] = get_args(FailMode)
GLOO_TEARDOWNS: tuple[str, ...] = get_args(GlooTeardown)


class SelftestOptions(Table):
    """[stages.selftest] options: how the stage for tests and benchmarks behaves and fails (workers/stages/selftest.py)."""

    steps: int = Field(10, ge=0, description="Steps to run; an attempt resumes after the steps done before it.")
    step_time: float = Field(0.05, ge=0, description="Seconds each step sleeps.")
    lines_per_sec: int = Field(0, ge=0, description="Log lines a second to write; 0: one line per step.")
    duration: float | None = Field(
        None, ge=0, description="With `lines_per_sec`: flood the log for this many seconds (sets the steps)."
    )
    tokens_per_step: int = Field(100, description="Tokens each step reports as done (for tok/s).")
    fail: FailMode | None = Field(None, description="How the failing rank fails; unset: no rank fails.")
    fail_rank: int = Field(0, ge=-1, description="The rank that fails (or hangs at the end); -1: every rank.")
    fail_at_step: int = Field(0, ge=0, description="Fail before doing this step (0-based).")
    # TOML arrays arrive as lists: strict=False lets them become the tuple (the items stay strict).
    fail_attempts: tuple[int, ...] | None = Field(
        None, strict=False, description="The attempt numbers that fail; unset: every attempt."
    )
    summary_on_fail: bool = Field(False, description="Rank 0 writes summary.json before it fails, as evaluate does.")
    heartbeat_for: float = Field(
        0.0, ge=0, description="First, this many seconds of a silent phase that shows only heartbeats."
    )
    heartbeat_evidence: Literal["ticks", "child", "none"] = Field(
        "ticks",
        description="What shows that phase working: `ticks`, a counter in its heartbeats; `child`, a child "
        "process burning CPU (an engine's stand-in, to be stopped); `none`, nothing (a hung phase whose "
        "heartbeat thread still runs).",
    )
    phase_budget: float | None = Field(None, gt=0, description="That phase's budget in seconds; unset: none.")
    hang_at_end: bool = Field(
        False, description="After its steps, rank `fail_rank` (-1: all) blocks for ever, writing nothing."
    )
    linger_thread: bool = Field(False, description="After its work, leave a non-daemon thread that never ends.")
    ignore_sigterm: bool = Field(
        False, description="Ignore SIGTERM: only SIGKILL ends the rank (the teardown waits out its grace)."
    )
    gloo_teardown: GlooTeardown | None = Field(
        None,
        description="Build a gloo group and a DDP model, then tear them down the old way (`naive`, which can "
        "deadlock) or eyas's (`safe`).",
    )

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
    # The hang bounds' defaults (docs/supervision.md, "Hangs"); a run overrides them in
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
