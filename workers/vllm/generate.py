"""Generation on a vLLM engine: the target answers token prompts, and its TP workers are supervised as the extract stage's are.

The engine is extract's (backend.Engine.launch: the same arguments, the same worker extension,
so every TP worker registers as a rank of the attempt with its own log and error file, and a
worker's exception is the root cause), without the capture: nothing is attached to the
workers. What differs from extraction, and why:
- max_model_len is the caller's (the longest prompt plus its answer, at most the target's
  context), not the longest sample + 1;
- enforce_eager only on vLLM's CPU build: on GPUs CUDA graphs make decoding several times
  faster, and nothing observes the modules; `[stages.<stage>] options.vllm` may set either way;
- prefix caching stays off (extract's setting) unless the options turn it on: with it, a
  batch's numbers would depend on what earlier batches left in the cache, and a resumed
  batch would not reproduce an interrupted one to the bit.

A batch of requests is sent whole and waited for (`generate`), as extraction sends its
batches: the engine's steps are then a function of the batch alone. Outputs come back as deltas
(RequestOutputKind.DELTA), so a long batch reports its tokens as they come (`on_tokens`), which
is the life the stall watchdog sees, and no step copies a request's whole answer. A request's
delta comes every STREAM_INTERVAL tokens (and with its first and its last), not at every step:
vLLM builds an output object per request per delta, and one per token cost the stage 2-4 % of
its tokens per second against `LLM.generate` (which builds one per answer) where decoding is
fast (tests/bench/bench_regenerate.py); the life the watchdog sees still comes every few steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from eyas.workers.vllm import version as vllm_version
from eyas.workers.vllm.backend import EXTENSION, Engine

log = logging.getLogger("eyas.vllm_generate")

REQUEST_PREFIX = "eyas-gen-"
STREAM_INTERVAL = 16  # tokens per delta of a request (SamplingParams.stream_interval), see above
# What vLLM reports for a finished request that eyas knows how to read: "stop" (a stop token,
# which vLLM keeps as the last of token_ids) and "length" (max_tokens, or max_model_len).
FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class Request:
    key: str  # unique within a batch; the request id is REQUEST_PREFIX + key
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int | None = None  # the request's own sampling seed (None: greedy needs none)


@dataclass(frozen=True)
class Output:
    tokens: tuple[int, ...]
    finish: str  # one of FINISH_REASONS


def engine_options(options: dict | None, cpu_build: bool) -> dict:
    """The run's `options.vllm` over what generation defaults to (see the module docstring)."""
    return {"enforce_eager": cpu_build, **(options or {})}


def launch(
    *,
    target_path: str,
    dtype: str,
    tp: int,
    trust_remote_code: bool,
    max_model_len: int,
    options: dict | None = None,
    model_cfg: dict | None = None,
    extension: str = EXTENSION,
) -> Engine:
    """A generation engine: extract's, its workers registered, nothing attached to them."""
    opts = engine_options(options, vllm_version.is_cpu_build())
    # Engine.launch writes max_len + 1; the run's options may set their own.
    return Engine.launch(
        target_path=target_path,
        dtype=dtype,
        tp=tp,
        trust_remote_code=trust_remote_code,
        max_len=max_model_len - 1,
        options=opts,
        extension=extension,
        model_cfg=model_cfg,
    )


def max_model_len(engine: Engine) -> int:
    """The context the running engine accepts (the options may have set it)."""
    return int(engine.llm.llm_engine.model_config.max_model_len)


def generate(
    engine: Engine,
    requests: Sequence[Request],
    *,
    temperature: float,
    top_p: float,
    stop_token_ids: Sequence[int],
    on_tokens: Callable[[int], None] | None = None,
) -> list[Output]:
    """Every request's answer, in the order of `requests`. The stop token that ended an answer
    is its last token (vLLM keeps it in token_ids). `on_tokens(n)` is told of every n tokens
    generated, step by step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    keys = [r.key for r in requests]
    if len(set(keys)) != len(keys):
        raise ValueError(f"generate: request keys repeat ({len(keys) - len(set(keys))} of {len(keys)})")
    llm_engine = engine.llm.llm_engine
    ids = {f"{REQUEST_PREFIX}{r.key}": r for r in requests}
    interval = stream_interval(SamplingParams)
    for rid, r in ids.items():
        params = SamplingParams(
            max_tokens=r.max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=r.seed if temperature > 0 else None,
            stop_token_ids=list(stop_token_ids),
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            **interval,
        )
        llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=list(r.prompt)), params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    finish: dict[str, str] = {}
    t0 = time.monotonic()
    while llm_engine.has_unfinished_requests():
        step = 0
        for out in llm_engine.step():
            if out.request_id not in ids:
                raise RuntimeError(f"vLLM returned request {out.request_id!r}, which eyas did not send")
            completion = out.outputs[0]
            tokens[out.request_id].extend(int(t) for t in completion.token_ids)
            step += len(completion.token_ids)
            if out.finished:
                finish[out.request_id] = str(completion.finish_reason)
        if on_tokens is not None and step:
            on_tokens(step)
    missing = sorted(set(ids) - set(finish))
    if missing:
        raise RuntimeError(f"vLLM finished {len(finish)} of {len(ids)} requests; missing: {missing[:5]}")
    odd = {rid: why for rid, why in finish.items() if why not in FINISH_REASONS}
    if odd:
        rid, why = next(iter(odd.items()))
        raise RuntimeError(f"vLLM ended request {rid} with finish_reason {why!r}, neither 'stop' nor 'length'")
    log.debug("generated %d answers in %.2f s", len(ids), time.monotonic() - t0)
    return [Output(tuple(tokens[rid]), finish[rid]) for rid in ids]


def stream_interval(params_cls) -> dict:
    """SamplingParams' stream_interval = STREAM_INTERVAL, where this vLLM has it (0.32 does)."""
    return (
        {"stream_interval": STREAM_INTERVAL}
        if "stream_interval" in getattr(params_cls, "__struct_fields__", ())
        else {}
    )
