"""vLLM engine settings that depend on the platform, not on the run.

Pure stdlib, so the evaluate stage and the tests can ask without importing vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path


def is_mla(target_config: dict) -> bool:
    """True for targets vLLM serves with multi-head latent attention (DeepseekV2/V3, Kimi-K2):
    their attention compresses K/V through a LoRA of rank `kv_lora_rank`."""
    text = target_config.get("text_config") if isinstance(target_config.get("text_config"), dict) else {}
    return bool(target_config.get("kv_lora_rank") or text.get("kv_lora_rank"))


def speculative_env(target_path: str | Path, on_gpu: bool) -> dict[str, str]:
    """Environment for a vLLM engine that runs an EAGLE-3 draft beside `target_path`.

    On CPU, vLLM 0.32 serves an MLA target with its reference CPU MLA kernel, which only takes
    16-token KV blocks, while the draft (a Llama decoder) needs blocks that are multiples of 32:
    the engine refuses with "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN:
    [MultipleOf(32)])". VLLM_MLA_DISABLE=1 serves the same weights through ordinary attention
    (the latent K/V expanded per head: the same function, more KV memory), which is also how
    vLLM's own EAGLE tests run DeepSeek targets. On GPU, MLA stays on: its kernels take the
    draft's block sizes, and MLA is what makes a 61-layer DeepseekV3 fit.
    """
    if on_gpu:
        return {}
    config = json.loads((Path(target_path) / "config.json").read_text())
    return {"VLLM_MLA_DISABLE": "1"} if is_mla(config) else {}


def with_native_rotary(args: dict) -> dict:
    """`args` with vLLM's PyTorch-native rotary embedding instead of its custom op.

    For MLA targets on vLLM's CPU build: the CPU rotary kernel mis-rotates MLA's strided query
    view (eyas.workers.vllm.engine says how), while the native path computes
    what transformers computes, which is what the draft learnt from."""
    compilation = dict(args.get("compilation_config") or {})
    compilation["custom_ops"] = [*compilation.get("custom_ops", []), "-rotary_embedding"]
    return {**args, "compilation_config": compilation}


# The dtypes whose weights vLLM's AMX MLA kernel packs (csrc/cpu: convert_weight_packed).
AMX_MLA_DTYPES = ("bfloat16", "float16", "half")
ATTENTION_KEYS = ("attention_backend", "attention_config")


def with_cpu_mla_backend(args: dict) -> dict:
    """`args` with vLLM's reference CPU MLA kernel named, where vLLM would pick one that cannot
    load the target.

    For MLA targets on vLLM's CPU build: on an x86 host with AMX tiles (Sapphire Rapids and
    later) vLLM prefers its AMX MLA kernel, whose weight packing takes only bf16 or fp16 weights,
    so a float32 target fails while loading with "expect weight to be bfloat16, float16, int8,
    fp8_e4m3 or uint8". The reference kernel (CPU_MLA, what hosts without AMX get anyway) takes
    any dtype. A backend the user named in the engine options stays theirs."""
    if str(args.get("dtype")) in AMX_MLA_DTYPES or any(args.get(k) for k in ATTENTION_KEYS):
        return args
    return {**args, "attention_backend": "CPU_MLA"}


def in_process_engine_env(on_gpu: bool) -> dict[str, str]:
    """Environment that keeps vLLM's engine core in the calling process, on the CPU build.

    By default vLLM starts an EngineCore process and, on the CPU build, forces a separate
    worker process even at tensor_parallel_size 1 (vllm/platforms/cpu.py): three Python
    processes that each import vLLM and torch, about 7 s each on these CPUs, before a tiny
    model loads. With VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine core runs in the caller and,
    at TP 1, so does the worker (vLLM's "uni" executor); TP > 1 still gets one worker process
    per rank. The caller must then be a process of its own (the evaluate stage's engine
    children are). On GPU vLLM's default stays: the serving layout, and a load there is
    dominated by weights, not imports."""
    return {} if on_gpu else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
