"""The canary's shrunken config (workers/canary/shrink.py): the class path kept, layers and experts cut, layer ids mapped in order."""

from __future__ import annotations

import pytest

from eyas.workers.canary.shrink import canary_depth, map_layer_ids, shrink

KIMI = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "auto_map": {"AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
    "text_config": {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "n_routed_experts": 384,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "vocab_size": 163840,
    },
    "quantization_config": {"quant_method": "compressed-tensors"},
}


def test_kimi_keeps_its_class_path_and_loses_layers_and_experts():
    s = shrink(KIMI, (2, 30, 58, 61))
    text = s.config["text_config"]
    assert (s.num_layers, s.canary_layers) == (61, 4)
    assert s.canary_ids == (1, 2, 3, 4)
    assert text["num_hidden_layers"] == 4 and text["n_routed_experts"] == 8
    assert text["first_k_dense_replace"] == 1  # one dense layer, then MoE layers
    # What picks the code path is untouched.
    for key in (
        "hidden_size",
        "kv_lora_rank",
        "q_lora_rank",
        "vocab_size",
        "intermediate_size",
        "moe_intermediate_size",
    ):
        assert text[key] == KIMI["text_config"][key]
    assert s.config["architectures"] == KIMI["architectures"] and s.config["auto_map"] == KIMI["auto_map"]
    assert s.config["quantization_config"] == KIMI["quantization_config"]
    assert s.changes == {"num_hidden_layers": [61, 4], "n_routed_experts": [384, 8]}
    assert KIMI["text_config"]["num_hidden_layers"] == 61  # the target's own dict is not touched
    assert s.as_json()["layer_ids"]["run"] == [2, 30, 58, 61]


def test_deepseek_v3_grouped_routing_becomes_one_group():
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": 61,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
    }
    s = shrink(cfg, (2, 30, 58, 61))
    assert s.config["n_routed_experts"] == 8
    assert (s.config["n_group"], s.config["topk_group"]) == (1, 1)
    assert s.config["first_k_dense_replace"] == 1


def test_dense_llama_keeps_per_layer_lists_in_step():
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, "layer_types": ["full_attention"] * 32}
    s = shrink(cfg, (2, 16, 29, 32))
    assert s.config["num_hidden_layers"] == 4 and s.config["layer_types"] == ["full_attention"] * 4
    assert "n_routed_experts" not in s.config


@pytest.mark.parametrize(
    ("ids", "n", "depth", "mapped"),
    [
        ((2, 30, 58, 61), 61, 4, (1, 2, 3, 4)),
        ((0, 4, 8), 8, 2, (0, 1, 2)),  # 0 and N keep their meaning
        ((3, 1, 2), 4, 4, (3, 1, 2)),  # order as written, each id distinct
        ((1, 2, 3, 4), 4, 4, (1, 2, 3, 4)),  # a shallow target is not shrunk
    ],
)
def test_layer_ids_map_in_order(ids, n, depth, mapped):
    assert canary_depth(ids, n) == depth
    assert map_layer_ids(ids, n, depth) == mapped


def test_a_config_without_depth_is_refused():
    with pytest.raises(ValueError, match="no num_hidden_layers"):
        shrink({"architectures": ["X"]}, (1, 2))
