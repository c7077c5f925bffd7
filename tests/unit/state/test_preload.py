"""state/preload.py, state/tpsizes.py, state/weightfiles.py: what `eyas submit` refuses of a target before any load, on target folders the tests write (config.json, and weight files that are empty or missing: nothing is opened but the index)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from doctor_models import DEEPSEEK_TEXT, TINY, make_weightless
from runtoml import run_toml

from eyas.state import preload, tpsizes
from eyas.state import runconfig as config
from eyas.state.weightfiles import scan

NO_WEIGHTS = "holds no weights (no *.safetensors file)"
DUMMY_FIX = 'or, to run on random weights, set stages.extract.options.vllm.load_format = "dummy"'


def load_run(tmp_path: Path, target: Path, pipeline=("extract",), **tables) -> config.RunConfig:
    """A run of `pipeline` on `target`, loaded as `eyas submit` loads it."""
    (tmp_path / "chat.jsonl").write_text("")
    tables.setdefault("extract", {"backend": "vllm"})
    text = run_toml("t", list(pipeline), target={"path": target}, data={"path": tmp_path / "chat.jsonl"}, **tables)
    (tmp_path / "run.toml").write_text(text)
    return config.load(tmp_path / "run.toml")


def dummy(stage: str = "extract") -> dict:
    return {stage: {"options": {"vllm": {"load_format": "dummy"}}}}


def test_a_target_without_weights_is_refused_for_the_stage_that_loads_them(tmp_path):
    target = make_weightless(tmp_path, None)
    cfg = load_run(tmp_path, target)
    assert preload.lines(cfg, "run.toml") == [
        f"run.toml: target.path: {target} {NO_WEIGHTS}, and extract (vllm) loads them; "
        f"put the checkpoint's *.safetensors files (and its index) there, {DUMMY_FIX}"
    ]


def test_the_explicit_dummy_weights_option_passes_the_weights_check(tmp_path):
    target = make_weightless(tmp_path, None)
    assert preload.problems(load_run(tmp_path, target, stages=dummy())) == []
    # Both vLLM stages asked for random weights: no stage loads any.
    cfg = load_run(tmp_path, target, ("extract", "evaluate"), stages={**dummy("extract"), **dummy("evaluate")})
    assert [ld.dummy for ld in preload.loaders(cfg)] == [True, True]
    assert preload.problems(cfg) == []
    # Only extract's: evaluate still loads the target, and the fix names its key alone.
    (p,) = preload.problems(load_run(tmp_path, target, ("extract", "evaluate"), stages=dummy("extract")))
    assert p.problem == f"{target} {NO_WEIGHTS}, and evaluate (vllm) loads them"
    assert p.fix.endswith('set stages.evaluate.options.vllm.load_format = "dummy"')


def test_stages_without_dummy_weights_get_no_dummy_fix(tmp_path):
    """transformers (hf extract) and speculators (train's verifier weights) have no dummy option."""
    target = make_weightless(tmp_path, None)
    (p,) = preload.problems(load_run(tmp_path, target, ("extract", "train"), stages=dummy()))
    assert (p.key, p.problem, p.fix) == (
        "target.path",
        f"{target} {NO_WEIGHTS}, and train (speculators) loads them",
        "put the checkpoint's *.safetensors files (and its index) there",
    )
    (p,) = preload.problems(load_run(tmp_path, target, extract={"backend": "hf"}))
    assert p.problem == f"{target} {NO_WEIGHTS}, and extract (transformers) loads them"
    # prepare and vocab read the tokenizer and config.json only.
    assert preload.problems(load_run(tmp_path, target, ("prepare", "vocab"))) == []


def test_an_index_naming_a_missing_shard_is_refused(tmp_path):
    target = make_weightless(tmp_path, None, weights="index")
    files = scan(target)
    assert (files.shards, files.missing, files.complete) == (
        ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"),
        ("model-00002-of-00002.safetensors",),
        False,
    )
    (p,) = preload.problems(load_run(tmp_path, target))
    assert p.problem == (
        f"{target}/model.safetensors.index.json names 2 shards, 1 of them missing "
        "(model-00002-of-00002.safetensors), and extract (vllm) loads them"
    )
    assert p.fix == f"finish downloading the checkpoint (every file the index names), {DUMMY_FIX}"
    (target / "model-00002-of-00002.safetensors").touch()
    assert preload.problems(load_run(tmp_path, target)) == []
    assert scan(target).size() == 4_000_000  # the index's metadata.total_size


def test_an_unusable_index_is_refused(tmp_path):
    target = make_weightless(tmp_path, None, weights="complete")
    (target / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": []}')
    (p,) = preload.problems(load_run(tmp_path, target))
    assert p.problem == (
        f"{target}/model.safetensors.index.json is unusable (ValueError: weight_map is [], not a table of "
        "tensor names to files), and extract (vllm) loads them"
    )


def test_pickled_weights_alone_are_refused_because_eyas_never_unpickles(tmp_path):
    target = make_weightless(tmp_path, None, weights="bin")
    (p,) = preload.problems(load_run(tmp_path, target))
    assert p.problem == (
        f"{target} holds only pickled weights (pytorch_model.bin), no *.safetensors, and extract (vllm) loads them"
    )
    assert p.fix.startswith("eyas never unpickles a checkpoint: use its *.safetensors files")


def test_tp_3_on_two_heads_names_the_key_and_the_sizes_that_work(tmp_path):
    target = make_weightless(tmp_path, None, weights="complete")
    cfg = load_run(tmp_path, target, extract={"backend": "vllm", "tensor_parallel_size": 3})
    assert preload.lines(cfg, "run.toml") == [
        "run.toml: extract.tensor_parallel_size: 3 does not divide num_attention_heads = 2; sizes that work: 1, 2"
    ]
    # evaluate defaults to extract's size: one line, which says so.
    cfg = load_run(tmp_path, target, ("extract", "evaluate"), extract={"backend": "vllm", "tensor_parallel_size": 3})
    assert [p.line("r") for p in preload.problems(cfg)] == [
        "r: extract.tensor_parallel_size: 3 does not divide num_attention_heads = 2 (evaluate runs at 3 too); "
        "sizes that work: 1, 2"
    ]
    # Set apart, each is its own line; the hf backend runs at TP 1 and is not judged.
    cfg = load_run(
        tmp_path, target, ("extract", "evaluate"), extract={"backend": "hf"}, evaluate={"tensor_parallel_size": 4}
    )
    assert [p.line("r") for p in preload.problems(cfg)] == [
        "r: evaluate.tensor_parallel_size: 4 does not divide num_attention_heads = 2; sizes that work: 1, 2"
    ]


def test_kv_heads_divide_tp_or_tp_divides_them():
    """vLLM's QKVParallelLinear: divide(kv, tp) when tp <= kv, else divide(tp, kv) (copies)."""
    cfg = {"num_attention_heads": 48, "num_key_value_heads": 8}
    found = tpsizes.rules(cfg)
    assert [str(r) for r in found] == ["num_attention_heads = 48", "num_key_value_heads = 8"]
    assert tpsizes.broken(16, found) == [] and tpsizes.broken(24, found) == []  # 8 KV heads copied
    assert tpsizes.describe(6, tpsizes.broken(6, found)) == (
        "6 and num_key_value_heads = 8 do not divide one another (vLLM splits the KV heads over the TP ranks, "
        "or copies them when there are fewer)"
    )
    assert tpsizes.sizes_that_work(found) == [1, 2, 4, 8, 16, 24, 48]
    # No KV key: vLLM takes the attention heads; an MQA count of 1 divides every TP.
    assert [str(r) for r in tpsizes.rules({"num_attention_heads": 32})] == ["num_attention_heads = 32"]
    assert tpsizes.broken(32, tpsizes.rules({"num_attention_heads": 32, "multi_query_group_num": 1})) == []


def test_moe_targets_fit_their_experts_width_not_their_count():
    """DeepSeek-V3 (MLA: no KV-head rule) and a Kimi-K2.5 wrapper: TP splits each expert's
    moe_intermediate_size; 256 or 384 experts need not divide TP."""
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {**DEEPSEEK_TEXT}}
    for model in ({**DEEPSEEK_TEXT, "n_routed_experts": 256}, kimi):
        found = tpsizes.rules(model)
        assert [str(r) for r in found] == ["num_attention_heads = 128", "moe_intermediate_size = 2048"]
        assert tpsizes.sizes_that_work(found) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert tpsizes.describe(3, tpsizes.broken(3, found)) == (
        "3 does not divide num_attention_heads = 128, nor moe_intermediate_size = 2048 (the width of each "
        "routed expert, n_routed_experts = 384, which vLLM splits over the TP ranks without expert parallelism)"
    )


def test_expert_parallel_lifts_the_experts_rule(tmp_path):
    """A Mixtral-shaped target (its experts' width is intermediate_size): TP 8 on 8 heads fits
    the heads but not a width of 100, unless the run splits whole experts."""
    mixtral = {
        **TINY,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 100,
        "num_local_experts": 8,
    }
    target = make_weightless(tmp_path, None, weights="complete", cfg=mixtral)
    tp8 = {"backend": "vllm", "tensor_parallel_size": 8}
    (p,) = preload.problems(load_run(tmp_path, target, extract=tp8))
    assert p.problem == (
        "8 does not divide intermediate_size = 100 (the width of each routed expert, num_local_experts = 8, which "
        "vLLM splits over the TP ranks without expert parallelism)"
    )
    assert p.fix == (
        "sizes that work: 1, 2, 4, or keep 8 with whole experts per rank: "
        "set stages.extract.options.vllm.enable_expert_parallel = true"
    )
    ep = {"extract": {"options": {"vllm": {"enable_expert_parallel": True}}}}
    assert preload.problems(load_run(tmp_path, target, extract=tp8, stages=ep)) == []


@pytest.mark.parametrize("where", ["hub", "file"])
def test_only_a_local_directory_is_read(tmp_path, where):
    """A hub name (or anything but a folder) cannot be read here: no problem is made up for it
    (validate refuses a target.path that does not exist)."""
    target = make_weightless(tmp_path, None)
    cfg = load_run(tmp_path, target)
    elsewhere = "org/model" if where == "hub" else str(target / "config.json")
    moved = cfg.model_copy(update={"target": cfg.target.model_copy(update={"path": elsewhere})})
    assert preload.problems(moved) == []
    assert json.loads((target / "config.json").read_text()) == TINY
