"""vLLM engine settings that depend on the platform, not on the run.

Pure stdlib, so the evaluate stage and the tests can ask without importing vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path


def is_mla(target_config: dict) -> bool:
    """True for targets vLLM serves with multi-head latent attention (DeepseekV2/V3, Kimi-K2):
    their attention compresses K/V through a LoRA of rank `kv_lora_rank`."""
    text = target_config.get("text_config") or target_config
    return bool(text.get("kv_lora_rank"))


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
