"""The extract stage's vLLM engine (Engine): started with eyas's worker extension in every tensor-parallel worker, told what to capture, and sent whole batches of prefill-only requests whose hidden states the workers write.

Each rank's driver (backend.py) starts one, `vllm.LLM(tensor_parallel_size=tp,
enforce_eager=True, worker_extension_cls=eyas.workers.vllm.ext.EyasWorkerExtension)`, and
sends it prefill-only requests (`max_tokens=1`) made of the prepare stage's token ids. The
workers observe their decoder (capture.py) and TP rank 0 writes the files itself, so no
hidden state crosses a process boundary. The regenerate stage's engine (generate.py) is
launched with the same arguments (Engine.launch).

Engine settings eyas fixes, and why:
- enforce_eager: hooks observe modules only when the model runs eagerly;
- enable_prefix_caching=False: a cached prefix is never computed, so its states would
  never be seen;
- distributed_executor_backend="mp": every worker is a process of its own, which the
  daemon supervises as a rank;
- skip_tokenizer_init: requests are token ids; no tokenizer (nor its remote code) loads;
- max_model_len: the longest sample + 1 unless the run's options set it;
- on vLLM's CPU build, for MLA targets (DeepSeek-V2/V3, Kimi-K2): the custom rotary kernel
  is off (compilation_config custom_ops "-rotary_embedding", so vLLM's PyTorch-native rotary
  runs). vLLM 0.32's CPU `rotary_embedding` op mishandles MLA's query view q[..., nope:]
  (strided, several heads): it rotates head h of token t as if it sat at position t*H + h;
  the native path matches transformers. GPUs use another kernel.
Other engine arguments come from the stage's options: [stages.extract] options =
{ vllm = { max_num_batched_tokens = 2048, ... } }; `worker_extension` names another
extension class (a subclass of eyas's, for tests and experiments).

The supported vLLM releases are version.py's, checked at start-up before the engine loads
anything. What eyas touches inside vLLM, and how each supported release is met:
- worker_extension_cls (appended to the worker's bases), LLM.collective_rpc and the engine's
  add_request/step, the `VllmWorker-<rank>` process name, the worker's logger.exception
  before its FAILURE reply: stable APIs and behaviours of the V1 engine;
- the per-step batch layout: the V1 model runner keeps it (input_batch, query_start_loc);
  Model Runner V2, the default on GPUs where Triton exists (already so in 0.32), returns it
  from prepare_inputs. layout.py reads both, and checks every step against the model's
  own inputs, so a layout that moved fails loudly instead of mis-slicing;
- decoder layers `(positions, hidden_states, residual, ...)` returning (hidden, residual),
  and the final norm called as norm(hidden, residual), as in 0.32's deepseek_v2.py and
  llama.py; the tap reads the names from each loaded class's signature.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from eyas.workers.vllm import version as vllm_version
from eyas.workers.vllm.settings import is_mla, with_cpu_mla_backend, with_native_rotary

log = logging.getLogger("eyas.vllm_backend")

EXTENSION = "eyas.workers.vllm.ext.EyasWorkerExtension"
REQUEST_PREFIX = "eyas-"
# The engine arguments eyas sets itself, which [stages.extract] options.vllm may not override, are
# listed (and checked when a run is submitted) in state/specs.py: EXTRACT_ENGINE_ARGS.


def replies(result: Any, world: int) -> list[dict]:
    """One reply per TP rank from a collective_rpc result.

    `LLM.collective_rpc` returns a list, one entry per worker; the executor's
    `collective_rpc(..., unique_reply_rank=r)` returns rank r's reply alone. eyas's RPC
    methods always reply with a dict, so a list is a list of replies and a dict is one.
    (speculators indexed a single reply that was itself a list as if it were per-rank.)
    """
    if isinstance(result, dict):
        return [result]
    if isinstance(result, (list, tuple)) and all(isinstance(r, dict) for r in result):
        if len(result) not in (1, world):
            raise RuntimeError(f"collective_rpc returned {len(result)} replies for {world} TP ranks")
        return list(result)
    raise RuntimeError(
        f"collective_rpc returned {type(result).__name__}, not eyas's dict replies: "
        "is the worker extension eyas's (or a subclass of it)?"
    )


def reply_of(result: Any, world: int, tp_rank: int) -> dict:
    """TP rank `tp_rank`'s reply (a lone reply is taken as that rank's: unique_reply_rank)."""
    found = replies(result, world)
    if len(found) == 1:
        return found[0]
    by_rank = {r.get("tp_rank"): r for r in found}
    if tp_rank not in by_rank:
        raise RuntimeError(f"no reply from TP rank {tp_rank} (got ranks {sorted(by_rank)})")
    return by_rank[tp_rank]


def cpu_env(tp: int) -> dict[str, str]:
    """Environment vLLM's CPU build needs for tensor parallelism, unless already set: one
    OpenMP core set per TP rank (split of this process's cores) and no cores held back
    (otherwise the engine asserts that there are not enough NUMA nodes)."""
    if tp <= 1:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // tp)
    groups = [cores[i * per : (i + 1) * per] or cores[-1:] for i in range(tp)]
    bind = "|".join(",".join(map(str, g)) for g in groups)
    return {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def config_warnings(model_cfg: dict) -> list[str]:
    """Where vLLM will read the target's config.json otherwise than transformers does: the
    states then differ between the backends (and from what transformers computes)."""
    text = model_cfg.get("text_config") if isinstance(model_cfg.get("text_config"), dict) else model_cfg
    found = []
    if text.get("model_type") == "deepseek_v3" and "scoring_func" not in text:
        found.append(
            "config.json names no scoring_func: vLLM routes this DeepseekV3 target's experts with "
            "softmax (its DeepSeek-V2 default), transformers with sigmoid (DeepSeek-V3's); "
            'add "scoring_func": "sigmoid" if the target is a real DeepSeek-V3'
        )
    return found


def engine_args(
    target_path: str,
    dtype: str,
    tp: int,
    trust_remote_code: bool,
    max_len: int,
    extension: str,
    options: dict | None,
    model_cfg: dict | None = None,
    cpu_build: bool = False,
) -> dict[str, Any]:
    extra = dict(options or {})  # checked against the arguments below: state/specs.py, ExtractOptions
    args = {
        "model": target_path,
        "tokenizer": target_path,
        "dtype": dtype,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": 1,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "worker_extension_cls": extension,
        "distributed_executor_backend": "mp",
        "skip_tokenizer_init": True,
        "trust_remote_code": trust_remote_code,
        "max_model_len": max_len + 1,
        "disable_log_stats": True,
        "seed": 0,
    }
    args.update(extra)
    if cpu_build and is_mla(model_cfg or {}):
        args = with_cpu_mla_backend(with_native_rotary(args))
    return args


def load_extension(qualname: str) -> type:
    """Import the extension class here first: a typo fails now, not inside every worker."""
    import importlib

    module_name, _, cls_name = qualname.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(
            f"worker extension {qualname!r} cannot be imported ({exc}); name a class as "
            '"package.module.Class" that subclasses eyas.workers.vllm.ext.EyasWorkerExtension'
        ) from None
    from eyas.workers.vllm.ext import EyasWorkerExtension

    if not (isinstance(cls, type) and issubclass(cls, EyasWorkerExtension)):
        raise ValueError(
            f"worker extension {qualname} does not subclass eyas.workers.vllm.ext.EyasWorkerExtension, "
            "which registers the workers with the daemon and records their errors"
        )
    return cls


@dataclass
class Engine:
    """A running vLLM engine with eyas's extension set up in every worker."""

    llm: Any
    tp: int
    setup: list[dict]
    version: str

    @classmethod
    def start(
        cls,
        *,
        target_path: str,
        architecture: str,
        dtype: str,
        tp: int,
        trust_remote_code: bool,
        layer_ids: tuple[int, ...],
        hs_dir,
        max_len: int,
        options: dict | None = None,
        extension: str = EXTENSION,
        max_pending: int = 2,
        model_cfg: dict | None = None,
        hidden_dtype: str = "target",
        window=None,
    ) -> Engine:
        engine = cls.launch(
            target_path=target_path,
            dtype=dtype,
            tp=tp,
            trust_remote_code=trust_remote_code,
            max_len=max_len,
            options=options,
            extension=extension,
            model_cfg=model_cfg,
        )
        engine.attach(architecture, layer_ids, dtype, hs_dir, max_pending, hidden_dtype, window)
        return engine

    @classmethod
    def launch(
        cls,
        *,
        target_path: str,
        dtype: str,
        tp: int,
        trust_remote_code: bool,
        max_len: int,
        options: dict | None = None,
        extension: str = EXTENSION,
        model_cfg: dict | None = None,
    ) -> Engine:
        """The engine alone, its workers not yet observing anything (see attach)."""
        version = vllm_version.check()
        load_extension(extension)
        cpu = vllm_version.is_cpu_build()
        if cpu:
            for key, value in cpu_env(tp).items():
                os.environ.setdefault(key, value)
            # Else vLLM's CPU build reserves gpu_memory_utilization (0.92) of the machine's RAM
            # for KV cache and refuses to start whenever anything else holds memory; prefill-only
            # extraction needs little of it (the evaluate stage sets the same).
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        for warning in config_warnings(model_cfg or {}):
            log.warning("%s", warning)
        args = engine_args(target_path, dtype, tp, trust_remote_code, max_len, extension, options, model_cfg, cpu)
        t0 = time.monotonic()
        llm = LLM(**args)
        log.info("vLLM %s engine up in %.1f s (tensor_parallel_size=%d)", version, time.monotonic() - t0, tp)
        return cls(llm, tp, [], version)

    def attach(
        self,
        architecture: str,
        layer_ids,
        dtype: str,
        hs_dir,
        max_pending: int = 2,
        hidden_dtype: str = "target",
        window=None,
    ) -> None:
        """Set the capture up in every worker (TP rank 0 will write into `hs_dir`, storing the
        states as [storage] hidden_dtype says; with `window`, a streaming run's extract folder,
        each file counted in its ledger as it lands)."""
        spec = {
            "window": str(window) if window is not None else None,
            "architecture": architecture,
            "layer_ids": list(layer_ids),
            "dtype": dtype,
            "hs_dir": str(hs_dir),
            "writer_rank": 0,
            "max_pending": max_pending,
            "hidden_dtype": hidden_dtype,
        }
        self.setup = replies(self.llm.collective_rpc("eyas_setup", args=(spec,)), self.tp)
        first = reply_of(self.setup, self.tp, 0)
        log.info(
            "workers: %s (%s) -> %s at %s, %d layers of %s, hidden %d, %s runner, embeddings via %s()",
            first["model_class"],
            first["adapter"],
            first["decoder_class"],
            first["decoder_path"],
            first["num_layers"],
            first["layer_class"],
            first["hidden_size"],
            first["runner"],
            first["embed_api"],
        )

    def directory(self, path) -> int:
        """Streaming: the next batches' files go into `path`; returns the files written so far
        (every file of the folders before it has landed)."""
        return int(reply_of(self.llm.collective_rpc("eyas_directory", args=(str(path),)), self.tp, 0).get("written", 0))

    def written(self) -> int:
        """Files TP rank 0's writer has landed so far (streaming's in-flight accounting)."""
        return int(reply_of(self.llm.collective_rpc("eyas_written"), self.tp, 0).get("written", 0))

    def run(self, batch: list[tuple[int, list[int], bool]]) -> dict:
        """Prefill every (row, token ids, write?) of `batch`; returns TP rank 0's report."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = {f"{REQUEST_PREFIX}{idx}": (idx, tokens, write) for idx, tokens, write in batch}
        replies(self.llm.collective_rpc("eyas_expect", args=(ids,)), self.tp)
        engine = self.llm.llm_engine
        params = SamplingParams(max_tokens=1, detokenize=False)
        for rid, (_, tokens, _) in ids.items():
            engine.add_request(rid, TokensPrompt(prompt_token_ids=list(tokens)), params)
        finished: set[str] = set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished.add(out.request_id)
        if finished != set(ids):
            raise RuntimeError(
                f"vLLM finished {len(finished)} of {len(ids)} requests; missing: {sorted(set(ids) - finished)[:5]}"
            )
        return reply_of(self.llm.collective_rpc("eyas_collect"), self.tp, 0)

    def finish(self) -> dict:
        """Close the writer (every queued file lands), take the hooks off, and return TP rank
        0's totals."""
        return reply_of(self.llm.collective_rpc("eyas_finish"), self.tp, 0)

    def shutdown(self) -> None:
        if getattr(self, "_down", False):  # once: streaming shuts it down before waiting on train
            return
        self._down = True
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
