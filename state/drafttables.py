"""The run config's tables of how the draft is made: `[extract]`, `[draft]`, `[train]`, `[evaluate]` and `[storage]`, each key's type, default, bounds and meaning declared once.

`check_evaluate()` is validate()'s (state/runconfig.py) check of `[evaluate]` against the disk and
the rest of the file; the other tables' checks across tables are validate()'s own.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal, get_args

from pydantic import BeforeValidator, Field, ValidationInfo

from eyas.state.inputtables import DataConfig
from eyas.state.specs import Table
from eyas.state.target import layer_id_errors
from eyas.state.tomlcheck import AbsPath, Report

Backend = Literal["hf", "vllm"]
Strategy = Literal["ddp", "fsdp"]
StorageMode = Literal["offline", "streaming"]
HiddenDtype = Literal["target", "fp8"]
BACKENDS: tuple[str, ...] = get_args(Backend)
STRATEGIES: tuple[str, ...] = get_args(Strategy)
HIDDEN_DTYPES: tuple[str, ...] = get_args(HiddenDtype)


def _layer_ids(value: Any, info: ValidationInfo) -> Any:
    """Checked against the target's depth when validation knows it (context n_layers)."""
    if value is None:
        return None
    problems = layer_id_errors(value, (info.context or {}).get("n_layers"))
    if problems:
        raise ValueError("\n".join(problems))
    return tuple(value)


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


def check_evaluate(
    report: Report,
    data: dict,
    pipeline: tuple[str, ...],
    data_cfg: DataConfig | None,
    devices: Any,
    files: dict,
    extract_tp: int,
) -> EvaluateConfig:
    """[evaluate], with tensor_parallel_size defaulting to the run's (extract's) TP size."""
    ev = report.section(data, "evaluate", EvaluateConfig, files) or EvaluateConfig()
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
