"""Config-only model directories (a config.json, a tokenizer, safetensors headers of the right sizes) shaped like real targets, and run configs beside them, for `eyas doctor`."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from daemon_harness import daemon, wait_for  # noqa: F401 - the fixture
from runtoml import run_toml, toml_value

EYAS = str(Path(sys.executable).parent / "eyas")

KIMI_AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k25.KimiK25Config",
    "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
}
# The keys the memory check sizes activations and the KV cache from are DeepSeek-V3's own.
DEEPSEEK_TEXT = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_experts_per_tok": 8,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "n_routed_experts": 384,
    "first_k_dense_replace": 1,
}
MODELS = {
    # Kimi-K2.5: a multimodal wrapper around a DeepSeek-V3 language model, with its own code.
    "kimi": (
        {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "auto_map": KIMI_AUTO_MAP,
            "text_config": {**DEEPSEEK_TEXT, "vocab_size": 163840},
            # The routed experts ship as int4 (compressed-tensors): not a 16-bit checkpoint to fp8.
            "quantization_config": {"quant_method": "compressed-tensors"},
        },
        595_000_000_000,
        64,
    ),
    "deepseek": (
        {
            **DEEPSEEK_TEXT,
            "vocab_size": 129280,
            "n_routed_experts": 256,
            "quantization_config": {"quant_method": "fp8"},  # DeepSeek-V3 ships its weights in fp8
        },
        688_586_727_753,
        163,
    ),
    "llama": (
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "vocab_size": 128256,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
        },
        16_060_522_496,
        4,
    ),
}
H200 = 150_000_000_000
# A tiny Llama-shaped target with 2 attention heads (and 2 KV heads): tensor parallel 3 fits
# nothing. Its vocabulary is write_run's draft's, so that every pipeline validates.
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 4,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 32000,
}


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory) -> Path:
    """A small byte-level BPE tokenizer with a {% generation %} chat template, built once."""
    from eyas.workers.models.assets import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return out


def make_model(root: Path, kind: str, tokenizer: Path, template: bool = True, total_size: int | None = None) -> Path:
    cfg, size, n_shards = MODELS[kind]
    path = root / kind
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    shards = [f"model-{i:05d}-of-{n_shards:06d}.safetensors" for i in range(1, n_shards + 1)]
    index = {
        "metadata": {"total_size": total_size or size},
        "weight_map": {f"model.layers.{i}.weight": s for i, s in enumerate(shards)},
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    for s in shards:
        (path / s).touch()  # present, empty: nothing here is ever loaded
    for f in tokenizer.iterdir():
        if template or f.name != "chat_template.jinja":
            shutil.copy(f, path / f.name)
    return path


def make_weightless(root: Path, tokenizer: Path | None, weights: str = "none", cfg: dict | None = None) -> Path:
    """A target folder `root/tiny` with config.json (TINY unless `cfg`), the tokenizer's files
    and, by `weights`: "none", no weight file; "index", a safetensors index naming two shards,
    the second missing; "bin", only a pickled pytorch_model.bin (empty: nothing opens it);
    "complete", the index and both shards (empty)."""
    path = root / "tiny"
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg or TINY))
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    if weights in ("index", "complete"):
        index = {"metadata": {"total_size": 4_000_000}, "weight_map": {"a.weight": shards[0], "b.weight": shards[1]}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
        for s in shards if weights == "complete" else shards[:1]:
            (path / s).touch()
    elif weights == "bin":
        (path / "pytorch_model.bin").touch()
    elif weights != "none":
        raise ValueError(f"weights={weights!r}: use none, index, bin or complete")
    for f in tokenizer.iterdir() if tokenizer else ():
        shutil.copy(f, path / f.name)
    return path


def write_run(
    root: Path,
    target: Path,
    *,
    backend: str = "vllm",
    tp: int = 8,
    ids: list | None = None,
    trust: bool = True,
    devices: str = '"auto"',
    ranks: int = 1,
    pipeline: str | None = None,
    tokens: int | None = 10_000,
    dtype: str = "bfloat16",
    vllm_options: dict | None = None,
) -> Path:
    """A run config beside `target`; `tokens`: a prepare summary already in the output dir;
    `vllm_options`: the extract stage's vLLM engine arguments ([stages.extract] options.vllm)."""
    (root / "chat.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n' * 50
    )
    out = root / "out"
    if tokens is not None:
        (out / "prepare").mkdir(parents=True, exist_ok=True)
        (out / "prepare" / "summary.json").write_text(json.dumps({"tokens": tokens, "rows_out": 10}))
    text = run_toml(
        "doc",
        toml_value(pipeline) if pipeline else None,
        output_dir=out,
        target={"path": target, "dtype": dtype, "trust_remote_code": trust},
        data={"path": root / "chat.jsonl"},
        extract={"backend": backend, "tensor_parallel_size": tp, "layer_ids": ids},
        resources={"ranks": ranks, "devices": toml_value(devices)},
        draft={"vocab_size": 32000},
        stages={"extract": {"options": {"vllm": vllm_options}}} if vllm_options else None,
    )
    path = root / "run.toml"
    path.write_text(text)
    return path
