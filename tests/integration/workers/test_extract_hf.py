"""The extract stage on the transformers backend: hidden states against independent
references, the files' format, the adapters, resume, and a real daemon with a SIGKILLed rank."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path

import pytest
import torch
from daemon_harness import daemon, wait_for  # noqa: F401 (fixture)
from extract_harness import run_stage, sha256s, token_rows, write_dataset
from runtoml import extract_toml
from safetensors.torch import load_file

from eyas.workers.extract import hf as extract_hf
from eyas.workers.extract import hswriter
from eyas.workers.extract import plan as extract_plan
from eyas.workers.models import adapters, assets, hf_target
from eyas.workers.models.capture import LayerCapture

# Builds models and starts engines: `pytest -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow

FAMILIES = ("llama", "deepseek_v3")


# --- fixtures and helpers ------------------------------------------------------------------


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {f: assets.build_model(root / f, f) for f in FAMILIES}


def reference(model, input_ids: list[int]) -> tuple[dict[int, torch.Tensor], tuple]:
    """One sample, unbatched, through the full CausalLM forward, with this test's own hooks:
    the input of every decoder layer, and the *output* of the last one for id N."""
    layers = model.model.layers
    n = len(layers)
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layers[i].register_forward_pre_hook(
            lambda m, args, kwargs, i=i: seen.__setitem__(i, (args[0] if args else kwargs["hidden_states"]).clone()),
            with_kwargs=True,
        )
        for i in range(n)
    ]
    hooks.append(
        layers[n - 1].register_forward_hook(
            lambda m, args, out: seen.__setitem__(n, (out if torch.is_tensor(out) else out[0]).clone())
        )
    )
    try:
        with torch.inference_mode():
            out = model(torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    return {i: t[0] for i, t in seen.items()}, tuple(h[0] for h in out.hidden_states)


def load_hf(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


# --- the plan --------------------------------------------------------------------------------


def test_plan_is_longest_first_dealt_round_robin_and_covers_every_row_once():
    lengths = [5, 9, 3, 9, 7, 1, 8, 2, 6, 4, 10]
    assert extract_plan.plan_batches(lengths, 1, 0, 4) == [[10, 1, 3, 6], [4, 8, 0, 9], [2, 7, 5]]
    r0 = extract_plan.plan_batches(lengths, 2, 0, 3)
    r1 = extract_plan.plan_batches(lengths, 2, 1, 3)
    assert r0 == [[10, 3, 4], [0, 2, 5]]
    assert r1 == [[1, 6, 8], [9, 7]]
    assert sorted(i for b in r0 + r1 for i in b) == list(range(len(lengths)))
    # A pure function: the same inputs always give the same batches.
    assert extract_plan.plan_batches(lengths, 2, 1, 3) == r1
    assert extract_plan.plan_batches([], 2, 1, 3) == []
    with pytest.raises(ValueError, match="extract.batch_size = 0: use 1 or more"):
        extract_plan.plan_batches(lengths, 1, 0, 0)


# --- accuracy --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_match_unbatched_hook_reference_and_output_hidden_states(models, tmp_path, family):
    lengths = [37, 5, 23, 61, 12, 48, 29, 17, 3, 55]
    rows = token_rows(models[family], lengths)
    write_dataset(tmp_path / "out", rows)
    n = 8
    ids = list(range(n + 1))  # every id, 0 (embeddings) to N (final pre-norm)
    ctx = run_stage(tmp_path / "out", models[family], layer_ids=ids, batch_size=4)

    plan = extract_plan.plan_batches(lengths, 1, 0, 4)
    assert any(len({lengths[i] for i in b}) == len(b) > 1 for b in plan)  # mixed lengths per batch
    model = load_hf(models[family])
    hs_dir = tmp_path / "out" / "extract" / "hidden_states"
    for idx, row in enumerate(rows):
        got = load_file(hs_dir / f"hs_{idx}.safetensors")
        assert set(got) == {"hidden_states", "token_ids"}
        assert got["hidden_states"].shape == (lengths[idx], n + 1, model.config.hidden_size)
        assert got["hidden_states"].dtype == torch.float32 and got["token_ids"].dtype == torch.int64
        assert got["token_ids"].tolist() == row
        hooked, output_hs = reference(model, row)
        for k, layer_id in enumerate(ids):
            torch.testing.assert_close(got["hidden_states"][:, k], hooked[layer_id], atol=1e-5, rtol=0)
        # The documented mapping: output_hidden_states[i] is id i for i < N; its last entry
        # is the *normed* id N.
        assert len(output_hs) == n + 1
        for i in range(n):
            torch.testing.assert_close(got["hidden_states"][:, i], output_hs[i], atol=1e-5, rtol=0)
        with torch.inference_mode():
            normed = model.model.norm(got["hidden_states"][:, n])
        torch.testing.assert_close(normed, output_hs[n], atol=1e-5, rtol=0)
        assert (got["hidden_states"][:, n] - output_hs[n]).abs().max() > 0.1  # not the same thing

    cfg = json.loads((tmp_path / "out" / "extract" / "data_config.json").read_text())
    assert cfg["layer_ids"] == ids and cfg["verifier_last_layer_id"] == n and cfg["aux_layer_ids"] == ids[:-1]
    assert cfg["tensors"] == {
        "hidden_states": {"shape": ["seq_len", n + 1, model.config.hidden_size], "dtype": "float32"},
        "token_ids": {"shape": ["seq_len"], "dtype": "int64"},
    }
    assert cfg["layers"][0]["meaning"] == "embeddings: the residual stream entering decoder layer 0"
    assert cfg["layers"][n]["meaning"].startswith("the final pre-norm output")
    assert (cfg["num_samples"], cfg["num_tokens"], cfg["hidden_size"]) == (10, sum(lengths), model.config.hidden_size)
    assert cfg["model"]["architecture"] == model.config.architectures[0]
    assert cfg["hidden_states_dir"] == "hidden_states" and cfg["dataset"] == "../prepare/dataset"
    assert set(cfg["versions"]) == {"torch", "transformers", "speculators", "eyas"}
    assert all(cfg["versions"].values())
    summary = json.loads((ctx.attempt_dir / "summary.json").read_text())
    assert (summary["samples"], summary["tokens"], summary["files_written"], summary["batches_skipped"]) == (
        10,
        sum(lengths),
        10,
        0,
    )
    assert summary["outputs"] == [str(hs_dir), str(tmp_path / "out" / "extract" / "data_config.json")]
    lines = [json.loads(x) for x in (ctx.attempt_dir / "rank-0.progress.jsonl").read_text().splitlines()]
    assert (lines[0]["heartbeat"], lines[0]["phase"]["kind"]) == ("load target", "load")
    assert lines[0]["phase"]["budget"] >= 600 and "rchar" in lines[0]["phase"]["evidence"]
    lines = [x for x in lines if "heartbeat" not in x]
    assert (lines[0]["samples"], lines[0]["tokens"]) == (0, 0)
    assert (lines[-1]["samples"], lines[-1]["tokens"], lines[-1]["samples_total"], lines[-1]["tokens_total"]) == (
        10,
        sum(lengths),
        10,
        sum(lengths),
    )


def test_speculators_loader_reads_the_files(models, tmp_path):
    from hs_connectors import FileTransfer
    from speculators.train.data import ArrowDataset

    lengths = [20, 7, 33]
    rows = token_rows(models["llama"], lengths)
    ds_path = write_dataset(tmp_path / "out", rows)
    run_stage(tmp_path / "out", models["llama"], layer_ids=[2, 4, 5, 8])
    hs_dir = tmp_path / "out" / "extract" / "hidden_states"
    data = ArrowDataset(
        max_len=64,
        datapath=ds_path,
        transfer=FileTransfer(hs_dir),
        on_missing="raise",
        hidden_states_dtype=torch.float32,
    )
    for idx in range(3):
        item = data[idx]
        ours = load_file(hs_dir / f"hs_{idx}.safetensors")["hidden_states"]
        assert item["hidden_states"].shape == (lengths[idx], 3 * 128)
        torch.testing.assert_close(item["verifier_last_hidden_states"], ours[:, 3], atol=0, rtol=0)
        assert item["input_ids"].tolist() == rows[idx]


def test_bfloat16_files(models, tmp_path):
    lengths = [14, 40, 9, 26, 31]
    rows = token_rows(models["llama"], lengths)
    write_dataset(tmp_path / "out", rows)
    run_stage(tmp_path / "out", models["llama"], dtype="bfloat16", batch_size=3)  # default ids
    model = load_hf(models["llama"], torch.bfloat16)
    cfg = json.loads((tmp_path / "out" / "extract" / "data_config.json").read_text())
    assert cfg["layer_ids"] == [2, 4, 5, 8] and cfg["dtype"] == "bfloat16"
    assert cfg["tensors"]["hidden_states"]["dtype"] == "bfloat16"
    for idx, row in enumerate(rows):
        got = load_file(tmp_path / "out" / "extract" / "hidden_states" / f"hs_{idx}.safetensors")
        assert got["hidden_states"].dtype == torch.bfloat16 and got["token_ids"].dtype == torch.int64
        assert got["hidden_states"].shape == (lengths[idx], 4, 128)
        hooked, _ = reference(model, row)
        for k, layer_id in enumerate([2, 4, 5, 8]):
            # bf16 keeps 8 bits of mantissa: batched and unbatched matmuls round differently.
            torch.testing.assert_close(
                got["hidden_states"][:, k].float(), hooked[layer_id].float(), atol=0.1, rtol=0.02
            )


def test_out_of_memory_halves_the_batch_and_keeps_every_value(models, tmp_path):
    lengths = [30, 22, 15, 9, 4]
    rows = token_rows(models["llama"], lengths)
    write_dataset(tmp_path / "out", rows)
    target = hf_target.load(str(models["llama"]), "float32")

    def fail_big(module, args, kwargs):
        if kwargs["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    handle = target.decoder.module.register_forward_pre_hook(fail_big, with_kwargs=True)
    plan = extract_plan.plan_batches(lengths, 1, 0, 5)
    ds = extract_plan.load_dataset(tmp_path / "out" / "prepare" / "dataset")
    hs_dir = tmp_path / "hs"
    stats = extract_hf.run(target, (2, 8), ds, lengths, plan, hs_dir, "float32")
    handle.remove()
    assert (stats.written, stats.computed) == (5, 5)
    model = load_hf(models["llama"])
    for idx, row in enumerate(rows):
        got = load_file(hs_dir / f"hs_{idx}.safetensors")["hidden_states"]
        hooked, _ = reference(model, row)
        torch.testing.assert_close(got[:, 0], hooked[2], atol=1e-5, rtol=0)
        torch.testing.assert_close(got[:, 1], hooked[8], atol=1e-5, rtol=0)


# --- adapters --------------------------------------------------------------------------------


def test_unknown_architecture_fails_at_once_listing_the_known_ones(tmp_path):
    target = tmp_path / "odd"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "num_hidden_layers": 4}))
    # No weights and no dataset exist: the architecture check comes before either is read.
    with pytest.raises(adapters.UnknownArchitecture) as err:
        run_stage(tmp_path / "out", target)
    known = ", ".join(sorted(a for ad in adapters.ADAPTERS for a in ad.architectures))
    assert str(err.value) == (
        f"architecture 'MambaForCausalLM' is not supported for extraction; known: {known} "
        "(add an adapter in eyas/workers/models/adapters.py)"
    )
    assert "DeepseekV3ForCausalLM, KimiK25ForConditionalGeneration, LlamaForCausalLM" in known
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    with pytest.raises(adapters.UnknownArchitecture, match='config.json names no architectures; set "architectures"'):
        run_stage(tmp_path / "out", target)


class KimiK25ForConditionalGeneration(torch.nn.Module):
    """Shaped like Kimi-K2.5's remote code: a vision tower beside a whole causal LM."""

    def __init__(self, lm):
        super().__init__()
        self.vision_tower = torch.nn.Linear(4, 4)
        self.language_model = lm


class LlavaForConditionalGeneration(torch.nn.Module):
    """Shaped like transformers 5.x Llava: model.language_model is the bare decoder."""

    def __init__(self, lm):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.vision_tower = torch.nn.Linear(4, 4)
        self.model.language_model = lm.model
        self.lm_head = lm.lm_head


@pytest.mark.parametrize(
    "wrapper, path",
    [
        (KimiK25ForConditionalGeneration, "language_model.model"),
        (LlavaForConditionalGeneration, "model.language_model"),
    ],
)
def test_multimodal_wrapper_resolves_to_its_language_model(models, tmp_path, wrapper, path):
    lengths = [19, 8, 27, 13]
    rows = token_rows(models["llama"], lengths)
    write_dataset(tmp_path / "out", rows)
    run_stage(tmp_path / "out", models["llama"], layer_ids=[0, 3, 8])
    plain = tmp_path / "out" / "extract" / "hidden_states"

    lm = load_hf(models["llama"])
    model = wrapper(lm)
    adapter, decoder = adapters.resolve(model)
    assert (adapter.family, decoder.path, decoder.num_layers) == ("multimodal", path, 8)
    assert decoder.module is lm.model and decoder.norm is lm.model.norm
    target = hf_target.Target(model, type(model).__name__, adapter, decoder, "llama")
    ds = extract_plan.load_dataset(tmp_path / "out" / "prepare" / "dataset")
    hs_dir = tmp_path / "wrapped"
    extract_hf.run(target, (0, 3, 8), ds, lengths, extract_plan.plan_batches(lengths, 1, 0, 4), hs_dir, "float32")
    # The same decoder on the same batches: the same bytes as the plain model's run.
    for idx in range(len(rows)):
        name = f"hs_{idx}.safetensors"
        assert (hs_dir / name).read_bytes() == (plain / name).read_bytes()


KIMI_CONFIG_PY = """
from transformers import LlamaConfig, PretrainedConfig


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"

    def __init__(self, text_config=None, **kwargs):
        self.text_config = text_config if isinstance(text_config, LlamaConfig) else LlamaConfig(**(text_config or {}))
        super().__init__(**kwargs)
"""

KIMI_MODELING_PY = """
import torch
from transformers import LlamaForCausalLM, PreTrainedModel

from .configuration_kimi import KimiK25Config


class KimiK25ForConditionalGeneration(PreTrainedModel):
    config_class = KimiK25Config
    base_model_prefix = "language_model"

    def __init__(self, config):
        super().__init__(config)
        self.vision_tower = torch.nn.Linear(4, 4)
        self.language_model = LlamaForCausalLM(config.text_config)
        self.post_init()
"""


def test_remote_code_multimodal_target_runs_through_the_stage(models, tmp_path):
    """A Kimi-K2.5-shaped checkpoint with its own code (auto_map), holding the tiny Llama's
    weights under language_model.: the stage loads it, finds language_model.model, and writes
    the same bytes as the plain Llama."""
    from safetensors.torch import save_file

    target = tmp_path / "kimi"
    target.mkdir()
    (target / "configuration_kimi.py").write_text(KIMI_CONFIG_PY)
    (target / "modeling_kimi.py").write_text(KIMI_MODELING_PY)
    llama_cfg = json.loads((models["llama"] / "config.json").read_text())
    text = {k: v for k, v in llama_cfg.items() if k not in ("architectures", "transformers_version", "dtype")}
    (target / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["KimiK25ForConditionalGeneration"],
                "model_type": "kimi_k25",
                "text_config": text,
                "auto_map": {
                    "AutoConfig": "configuration_kimi.KimiK25Config",
                    "AutoModel": "modeling_kimi.KimiK25ForConditionalGeneration",
                },
            }
        )
    )
    weights = {
        f"language_model.{k}": v.contiguous() for k, v in load_file(models["llama"] / "model.safetensors").items()
    }
    weights.update({"vision_tower.weight": torch.zeros(4, 4), "vision_tower.bias": torch.zeros(4)})
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})

    rows = token_rows(models["llama"], [21, 9, 30])
    for name in ("plain", "kimi"):
        write_dataset(tmp_path / name, rows)
    run_stage(tmp_path / "plain", models["llama"], layer_ids=[1, 8])
    with pytest.raises(
        ValueError,
        match="architecture KimiK25ForConditionalGeneration is not built into "
        "transformers .*; set target.trust_remote_code = true",
    ):
        run_stage(tmp_path / "kimi", target, layer_ids=[1, 8])
    run_stage(tmp_path / "kimi", target, layer_ids=[1, 8], trust_remote_code=True)
    cfg = json.loads((tmp_path / "kimi" / "extract" / "data_config.json").read_text())
    assert cfg["model"] == {
        "path": str(target),
        "architecture": "KimiK25ForConditionalGeneration",
        "model_type": "kimi_k25",
        "adapter": "multimodal",
        "decoder": "language_model.model",
    }
    plain = sha256s(tmp_path / "plain" / "extract")
    kimi = sha256s(tmp_path / "kimi" / "extract")
    assert {k: v for k, v in kimi.items() if k != "data_config.json"} == {
        k: v for k, v in plain.items() if k != "data_config.json"
    }


def test_wrapper_without_a_decoder_names_the_paths_it_tried():
    model = KimiK25ForConditionalGeneration(torch.nn.Linear(2, 2))
    with pytest.raises(adapters.UnknownArchitecture) as err:
        adapters.resolve(model)
    assert str(err.value) == (
        "KimiK25ForConditionalGeneration: no decoder layers found at language_model.model.layers, "
        "model.language_model.layers, language_model.layers (adapter multimodal); the model's layout "
        "is not the one this adapter knows"
    )


TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=300,
)


def _tiny_config(arch: str):
    from transformers import AutoConfig

    vision = {
        "Llava": dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        "Mistral3": dict(
            model_type="pixtral",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=16,
            image_size=28,
            patch_size=14,
        ),
    }
    vl_vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    return {
        "LlamaForCausalLM": lambda: AutoConfig.for_model("llama", **TINY),
        "MistralForCausalLM": lambda: AutoConfig.for_model("mistral", **TINY),
        "Qwen2ForCausalLM": lambda: AutoConfig.for_model("qwen2", **TINY),
        "Qwen3ForCausalLM": lambda: AutoConfig.for_model("qwen3", **TINY),
        "Qwen3MoeForCausalLM": lambda: AutoConfig.for_model(
            "qwen3_moe", **TINY, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2
        ),
        "DeepseekV3ForCausalLM": lambda: AutoConfig.for_model(
            "deepseek_v3",
            **{k: v for k, v in TINY.items() if k != "head_dim"},
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
        ),
        "LlavaForConditionalGeneration": lambda: AutoConfig.for_model(
            "llava", text_config=dict(model_type="llama", **TINY), vision_config=vision["Llava"]
        ),
        "Mistral3ForConditionalGeneration": lambda: AutoConfig.for_model(
            "mistral3", text_config=dict(model_type="mistral", **TINY), vision_config=vision["Mistral3"]
        ),
        "Qwen2_5_VLForConditionalGeneration": lambda: AutoConfig.for_model(
            "qwen2_5_vl",
            text_config=dict(**TINY, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
            vision_config=vl_vision,
        ),
        "Qwen3VLForConditionalGeneration": lambda: AutoConfig.for_model(
            "qwen3_vl", text_config=dict(**TINY), vision_config=vl_vision
        ),
    }[arch]()


BUILTIN = [a for a in adapters.known_architectures() if a != "KimiK25ForConditionalGeneration"]


@pytest.mark.parametrize("arch", BUILTIN)
def test_every_builtin_architecture_resolves_and_captures(arch):
    """Each architecture an adapter claims, built tiny from transformers itself: the hooks see
    what output_hidden_states reports (ids < N) and the input of its final norm (id N)."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, arch)(_tiny_config(arch)).eval()
    adapter, decoder = adapters.resolve(model)
    assert decoder.num_layers == 3
    ids = torch.randint(0, 250, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.inference_mode(), LayerCapture(decoder, [0, 1, 2, 3]) as cap:
        out = decoder.module(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True)
        got = cap.take()
        for i in range(3):
            assert torch.equal(got[i], out.hidden_states[i])
        assert torch.equal(decoder.norm(got[3]), out.hidden_states[3])


def test_layer_ids_out_of_range_name_the_range(models, tmp_path):
    write_dataset(tmp_path / "out", token_rows(models["llama"], [5, 6]))
    with pytest.raises(ValueError, match=r"layer id 9 is out of range for a 8-layer target: use ids from 0 to 8"):
        run_stage(tmp_path / "out", models["llama"], layer_ids=[2, 9])


def test_missing_dataset_says_to_run_prepare(models, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no prepared dataset; run the prepare stage first"):
        run_stage(tmp_path / "out", models["llama"])


# --- resume (in process) -----------------------------------------------------------------------


def test_resume_skips_complete_batches_and_writes_only_missing_files(models, tmp_path):
    lengths = [31, 12, 44, 7, 25, 19, 38, 3, 16, 28, 9]
    rows = token_rows(models["deepseek_v3"], lengths)
    write_dataset(tmp_path / "out", rows)
    run_stage(tmp_path / "out", models["deepseek_v3"], batch_size=4)
    extract_dir = tmp_path / "out" / "extract"
    before = sha256s(extract_dir)
    plan = extract_plan.plan_batches(lengths, 1, 0, 4)  # [[2, 6, 0, 9], [4, 5, 8, 1], [10, 3, 7]]
    assert plan == [[2, 6, 0, 9], [4, 5, 8, 1], [10, 3, 7]]

    hs_dir = extract_dir / "hidden_states"
    # A killed attempt: one file of batch 2 missing, all of batch 3, a temp file half-written.
    for idx in (5, 10, 3, 7):
        (hs_dir / f"hs_{idx}.safetensors").unlink()
    (extract_dir / "data_config.json").unlink()
    stale = hs_dir / ".hs_10.safetensors.12345.0.tmp"
    stale.write_bytes(b"half")
    kept = {p.name: p.stat().st_ino for p in hs_dir.glob("hs_*.safetensors")}

    ctx = run_stage(tmp_path / "out", models["deepseek_v3"], batch_size=4)
    summary = json.loads((ctx.attempt_dir / "summary.json").read_text())
    assert (summary["batches_skipped"], summary["samples_computed"], summary["files_written"]) == (1, 7, 4)
    assert not stale.exists()
    # Files that existed were not rewritten (same inode: no rename over them) ...
    assert {n: (hs_dir / n).stat().st_ino for n in kept} == kept
    # ... and the output is byte-identical to the uninterrupted run.
    assert sha256s(extract_dir) == before
    lines = [json.loads(x) for x in (ctx.attempt_dir / "rank-0.progress.jsonl").read_text().splitlines()]
    assert (lines[0]["heartbeat"], lines[0]["phase"]["kind"]) == ("load target", "load")
    assert lines[0]["phase"]["budget"] >= 600 and "rchar" in lines[0]["phase"]["evidence"]
    lines = [x for x in lines if "heartbeat" not in x]
    assert (lines[0]["samples"], lines[0]["tokens"]) == (7, sum(lengths) - sum(lengths[i] for i in (5, 10, 3, 7)))
    assert (lines[-1]["samples"], lines[-1]["tokens"]) == (11, sum(lengths))


def test_writer_failure_fails_the_rank(tmp_path):
    blocker = tmp_path / "hs"
    writer = hswriter.HiddenStatesWriter(blocker)
    blocker.rename(tmp_path / "moved")  # the directory vanishes under the writer
    item = hswriter.Item(idx=0, row=0, length=2, token_ids=torch.tensor([1, 2]))
    writer.put(hswriter.Job(hidden=torch.zeros(1, 2, 3, 4), items=[item]))
    with pytest.raises(
        RuntimeError, match=r"writing hidden states to .*/hs failed: SafetensorError.*No such file or directory"
    ):
        writer.close()


# --- through the daemon ------------------------------------------------------------------------


def _toml(name: str, output_dir: Path, target: Path) -> str:
    return extract_toml(name, output_dir, target, backend="hf", ranks=2)


def test_daemon_two_ranks_sigkill_mid_extraction_then_retry_is_byte_identical(daemon, models, tmp_path):  # noqa: F811
    n = 240
    rng = random.Random(1)
    lengths = [rng.randint(40, 160) for _ in range(n)]
    rows = token_rows(models["deepseek_v3"], lengths)
    for name in ("whole", "killed"):
        write_dataset(tmp_path / name, rows)

    # The uninterrupted run.
    whole = daemon.submit(_toml("whole", tmp_path / "whole", models["deepseek_v3"]), "whole.toml")
    run = daemon.wait_run(whole, timeout=300)
    assert run["state"] == "succeeded", run
    (stage,) = run["stages"]
    assert stage["summary"]["samples"] == n and stage["summary"]["files_written"] == n
    assert [(r["rank"], r["exit_code"]) for r in stage["attempt_list"][0]["ranks"]] == [(0, 0), (1, 0)]
    reference_hashes = sha256s(tmp_path / "whole" / "extract")
    assert len(reference_hashes) == n + 1

    # The same run, with rank 1 SIGKILLed once it has written some files.
    killed = daemon.submit(_toml("killed", tmp_path / "killed", models["deepseek_v3"]), "killed.toml")
    hs_dir = tmp_path / "killed" / "extract" / "hidden_states"
    rank1 = set(i for b in extract_plan.plan_batches(lengths, 2, 1, 4) for i in b)
    pid = wait_for(
        lambda: (rs := daemon.ranks(killed, stage="extract")) and len(rs) == 2 and rs[1]["pid"],
        120,
        what="rank 1's pid",
    )
    wait_for(lambda: len(hswriter.existing(hs_dir) & rank1) >= 8, 120, 0.01, "rank 1 to write 8 files")
    os.kill(pid, signal.SIGKILL)
    run = daemon.wait_run(killed, timeout=120)
    assert run["state"] == "failed"
    root = run["stages"][0]["attempt_list"][-1]["root_cause"]
    assert (root["type"], root["rank"]) == ("SIGKILL", 1)
    done_before_retry = len(hswriter.existing(hs_dir))
    assert 8 <= done_before_retry < n, "the kill must land mid-extraction"
    assert not (tmp_path / "killed" / "extract" / "data_config.json").exists()

    out = daemon.cli("retry", killed)
    assert out.returncode == 0, out.stderr
    run = daemon.wait_run(killed, ("succeeded", "failed"), timeout=300)
    assert run["state"] == "succeeded", run
    summary = run["stages"][0]["summary"]
    assert summary["samples"] == n
    assert summary["files_written"] == n - done_before_retry  # nothing done twice
    assert summary["batches_skipped"] >= 1
    assert sha256s(tmp_path / "killed" / "extract") == reference_hashes


def test_an_output_dir_is_bound_to_one_extraction(tmp_path):
    """Resume trusts the files present; files of another model, dtype, layer set or data are refused."""
    from eyas.workers.extract.output import IDENTITY, claim_output

    ident = {
        "model": "/m",
        "architecture": "LlamaForCausalLM",
        "dtype": "float32",
        "layer_ids": [2, 4, 8],
        "dataset": "abc",
    }
    claim_output(tmp_path, ident)
    claim_output(tmp_path, dict(ident))  # the same extraction resumes
    assert json.loads((tmp_path / IDENTITY).read_text()) == ident
    with pytest.raises(RuntimeError) as err:
        claim_output(tmp_path, {**ident, "layer_ids": [2, 5, 8]})
    assert str(err.value) == (
        f"{tmp_path} holds the output of another extraction (layer_ids: [2, 4, 8] there, "
        f"[2, 5, 8] now); set another output_dir, or delete {tmp_path} to start over"
    )
    assert [p.name for p in tmp_path.iterdir()] == [IDENTITY]  # no temp file left


def test_dataset_digest_follows_the_token_ids(tmp_path):
    import datasets

    from eyas.workers.extract.output import dataset_digest

    def digest(rows):
        datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(tmp_path / "d")
        value = dataset_digest(datasets.load_from_disk(tmp_path / "d"))
        shutil.rmtree(tmp_path / "d")
        return value

    a = digest([[1, 2, 3], [4, 5]])
    assert a == digest([[1, 2, 3], [4, 5]])
    assert a != digest([[1, 2], [3, 4, 5]])  # same tokens, other rows
    assert a != digest([[1, 2, 3], [4, 6]])
