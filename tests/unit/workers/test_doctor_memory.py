"""`eyas doctor`'s memory arithmetic without a target folder: vLLM's default utilization read
from (planted) vLLM sources, the model's shape from config.json keys, the evaluate stage's
engine, online fp8 and a run's own batch options, and the fixes each failure names."""

from __future__ import annotations

from pathlib import Path

import pytest

from eyas.state.drafttables import EvaluateConfig, ExtractConfig
from eyas.state.executiontables import StageConfig
from eyas.state.inputtables import DataConfig
from eyas.state.runconfig import RunConfig
from eyas.workers.doctor import memory as doctor_memory
from eyas.workers.doctor import memoryestimate

GB = 10**9
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}
LLAMA_BYTES = 16_060_522_496


def _vllm_source(root: Path, line: str | None) -> str:
    (root / "config").mkdir(parents=True)
    if line is not None:
        (root / "config" / "cache.py").write_text(f"class CacheConfig:\n    {line}\n    other: int = 3\n")
    return str(root)


@pytest.mark.parametrize(
    "line, expected",
    [
        ("gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1)", (0.92, "the installed vLLM's default")),
        ("gpu_memory_utilization: float = 0.9", (0.9, "the installed vLLM's default")),
        ("gpu_memory_utilization: float = Field(default=0.85)", (0.85, "the installed vLLM's default")),
        ("gpu_memory_utilization: float = DEFAULT", (0.9, "vLLM's usual default")),
        (None, (0.9, "vLLM's usual default")),
    ],
)
def test_vllms_default_utilization_is_read_from_its_source(tmp_path, line, expected):
    assert memoryestimate.vllm_default_utilization(_vllm_source(tmp_path / "vllm", line)) == expected


def test_the_installed_vllms_default_is_read_without_importing_it():
    import subprocess
    import sys

    code = (
        "import sys; from eyas.workers.doctor import memoryestimate; "
        "print(memoryestimate.vllm_default_utilization()[0], 'vllm' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[1:] == ["False", "False"]
    assert 0.5 <= float(out[0]) <= 1.0


def test_the_shape_comes_from_config_json_or_its_text_config():
    llama = memoryestimate.shape_of(LLAMA_8B)
    assert (llama.kv_heads, llama.head_dim, llama.intermediate, llama.moe_intermediate, llama.mla_width) == (
        8,
        128,
        14336,
        None,
        None,
    )
    wrapped = memoryestimate.shape_of(
        {
            "text_config": {
                "hidden_size": 7168,
                "num_hidden_layers": 61,
                "kv_lora_rank": 512,
                "qk_rope_head_dim": 64,
                "moe_intermediate_size": 2048,
                "n_routed_experts": 384,
                "num_experts_per_tok": 8,
            },
            "quantization_config": {"quant_method": "compressed-tensors"},
        }
    )
    assert (wrapped.mla_width, wrapped.moe_intermediate, wrapped.experts_per_token, wrapped.quantized) == (
        576,
        2048,
        8,
        "compressed-tensors",
    )
    # No MLP width given: the classic 4 × hidden. No depth: no shape at all.
    assert memoryestimate.shape_of({"hidden_size": 1024, "num_hidden_layers": 2}).intermediate == 4096
    assert memoryestimate.shape_of({"hidden_size": 1024}) is None
    assert memoryestimate.shape_of(None) is None


def _cfg(tmp_path: Path, **keys) -> RunConfig:
    (tmp_path / "chat.jsonl").write_text("")
    return RunConfig(name="t", data=DataConfig(path=str(tmp_path / "chat.jsonl")), **keys)


def _gpus(total: int, name: str = "NVIDIA L4", n: int = 1, used: int = 0) -> list[dict]:
    return [{"index": i, "name": name, "mem_total": total, "mem_used": used} for i in range(n)]


def test_a_16_bit_llama_on_a_24gb_gpu_is_told_fp8_or_two_gpus(tmp_path):
    cfg = _cfg(tmp_path, extract=ExtractConfig(backend="vllm"))
    mem = doctor_memory.memory(cfg, LLAMA_BYTES, _gpus(24 * GB, n=2), model=LLAMA_8B)
    # Under 70 GiB vLLM schedules 8192 tokens a step and samples 256 sequences; GQA caches 8 KV
    # heads of 128 per layer for 8 sequences of 2049 tokens.
    activations = 8192 * 2 * (4 * 4096 + 3 * 14336) + 256 * 128256 * 4
    kv = 8 * 2049 * 32 * 2 * 8 * 128 * 2
    assert mem.data["need"] == LLAMA_BYTES + activations + kv + 2**30 == 20_387_209_216
    assert (mem.verdict, mem.data["capacity"]) == ("pass", int(memoryestimate.vllm_default_utilization()[0] * 24 * GB))
    small = doctor_memory.memory(cfg, LLAMA_BYTES, _gpus(16 * GB, n=2), model=LLAMA_8B)
    assert small.verdict == "fail"
    # fp8 halves all but the embedding and the LM head (2 × 128256 × 4096 × 2 bytes).
    kept = 2 * 128256 * 4096 * 2
    fp8 = kept + (LLAMA_BYTES - kept) // 2 + activations + kv + 2**30
    assert small.fix == (
        'quantize to fp8 ([stages.extract] options = { vllm = { quantization = "fp8" } }: '
        f"{fp8 / GB:.2f} GB per GPU); or raise extract.tensor_parallel_size to 2"
    )


def test_the_runs_fp8_and_batch_options_are_what_is_sized(tmp_path):
    options = {"vllm": {"quantization": "fp8", "max_num_batched_tokens": 2048, "max_num_seqs": 16}}
    cfg = _cfg(tmp_path, extract=ExtractConfig(backend="vllm"), stages={"extract": StageConfig(options=options)})
    mem = doctor_memory.memory(cfg, LLAMA_BYTES, _gpus(16 * GB), model=LLAMA_8B)
    kept = 2 * 128256 * 4096 * 2
    assert mem.data["per_gpu_weights"] == kept + (LLAMA_BYTES - kept) // 2
    assert mem.data["activations"] == 2048 * 2 * (4 * 4096 + 3 * 14336) + 16 * 128256 * 4
    assert (mem.data["fp8"], mem.data["step_tokens"], mem.verdict) == (True, 2048, "pass")
    assert mem.detail.startswith("weights 9.08 GB/GPU (16.06 GB as fp8) + activations 251.48 MB (2048 tokens a step)")


def test_an_evaluate_only_run_is_sized_for_the_evaluate_engine(tmp_path):
    cfg = _cfg(
        tmp_path,
        pipeline=("evaluate",),
        evaluate=EvaluateConfig(tensor_parallel_size=2, batch_size=4, max_tokens=128, num_speculative_tokens=3),
    )
    mem = doctor_memory.memory(cfg, LLAMA_BYTES, _gpus(80 * GB, "NVIDIA H100 80GB HBM3", n=2), model=LLAMA_8B)
    # The longest prompt (data.max_length), its answer and one round of drafts + 8; 4 sequences.
    assert (mem.data["stage"], mem.data["tp"], mem.data["max_model_len"]) == ("evaluate", 2, 2048 + 128 + 3 + 8)
    assert mem.data["kv_tokens"] == 4 * 2187
    assert mem.data["kv_cache"] == 4 * 2187 * 32 * 2 * 4 * 128 * 2  # 8 KV heads ÷ TP 2
    assert mem.verdict == "pass"


def test_a_utilization_above_the_free_memory_names_the_one_that_starts(tmp_path):
    cfg = _cfg(tmp_path, extract=ExtractConfig(backend="vllm"))
    mem = doctor_memory.memory(cfg, LLAMA_BYTES, _gpus(80 * GB, "NVIDIA H100 80GB HBM3", used=40 * GB), model=LLAMA_8B)
    assert mem.verdict == "fail" and mem.detail.endswith(
        "but only 40.00 GB is free there (other processes hold 40.00 GB): vLLM refuses to start"
    )
    assert mem.fix.startswith(
        "free the 40.00 GB other processes hold on GPU 0; "
        "or set [stages.extract] options = { vllm = { gpu_memory_utilization = 0.50 } }"
    )
