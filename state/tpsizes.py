"""The tensor-parallel sizes vLLM can build a target at, from the numbers in its config.json: one Rule per number TP must fit.

The rules are vLLM's own (read in vLLM 0.32's source; 0.33's are the same), each of which
otherwise fails the engine's start with an error far from the run's config:

- attention heads: `ModelConfig.verify_with_parallel_config` (vllm/config/model.py) raises
  unless TP divides `num_attention_heads`, inside the pydantic validation of the engine's
  config, so the user meets a multi-line `ValidationError`.
- KV heads: `QKVParallelLinear` (vllm/model_executor/layers/linear.py) splits the KV heads over
  the TP ranks when there are at least TP of them (`divide(kv_heads, tp)`) and copies each onto
  `tp / kv_heads` ranks when there are fewer (`divide(tp, kv_heads)`): TP must divide the KV
  heads, or the KV heads divide TP. The key is the first of vLLM's names that config.json has
  (`get_total_num_kv_heads`), else the attention heads. A model with multi-head latent attention
  (`kv_lora_rank`: DeepSeek-V2/V3, Kimi-K2) caches one latent per token and has no KV heads to
  split, so it gets no KV rule.
- routed experts: without expert parallelism every TP rank holds every expert, each expert's MLP
  split over the ranks: `FusedMoEConfig` (vllm/model_executor/layers/fused_moe/config.py)
  asserts `intermediate_size % tp_size == 0`, that width being the expert's
  (`moe_intermediate_size` for DeepSeek, Kimi and Qwen MoE; `intermediate_size` for Mixtral,
  whose experts are its MLPs). The number of experts need not divide TP, with or without expert
  parallelism: with `enable_expert_parallel` each rank takes whole experts and the first ranks
  one more when they do not share evenly (`determine_expert_map`), so that run gets no expert
  rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eyas.state.target import text_value

# vLLM's names for these numbers, in the order it reads them (transformers_utils/
# model_arch_config_convertor.py).
KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups")
EXPERT_KEYS = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")
# Without a head count to bound them, sizes that work are listed up to this.
MAX_LISTED = 64


@dataclass(frozen=True)
class Rule:
    key: str  # the config.json key the number comes from
    value: int
    either_way: bool = False  # True: TP divides value, or value divides TP (KV heads)
    why: str = ""  # said after a broken rule: why vLLM needs it

    def __str__(self) -> str:
        return f"{self.key} = {self.value}"

    def allows(self, tp: int) -> bool:
        return self.value % tp == 0 or (self.either_way and tp % self.value == 0)

    def broken(self, tp: int, first: bool = True) -> str:
        """What is wrong with `tp`, in words: "3 does not divide num_attention_heads = 2"; after
        another broken rule (`first` False): "nor num_key_value_heads = 8 ..."."""
        if self.either_way:
            text = f"{tp} and {self.key} = {self.value} do not divide one another"
            text = text if first else f"and {text}"
        else:
            text = f"{tp} does not divide {self} " if first else f"nor {self} "
        return f"{text.rstrip()} ({self.why})" if self.why else text.rstrip()


def describe(tp: int, bad: list[Rule]) -> str:
    """The broken rules of `tp` as one phrase."""
    return ", ".join(r.broken(tp, first=i == 0) for i, r in enumerate(bad))


def _count(model_cfg: dict[str, Any], key: str) -> int | None:
    v = text_value(model_cfg, key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _first(model_cfg: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, int] | None:
    for key in keys:
        v = _count(model_cfg, key)
        if v is not None:
            return key, v
    return None


def rules(model_cfg: dict[str, Any], expert_parallel: bool = False) -> list[Rule]:
    """The numbers of `model_cfg` that a TP size must fit in vLLM (see the module's docstring);
    a number config.json lacks gives no rule."""
    out = []
    heads = _count(model_cfg, "num_attention_heads")
    if heads is not None:
        out.append(Rule("num_attention_heads", heads))
    if text_value(model_cfg, "kv_lora_rank") is None:
        kv = _first(model_cfg, KV_HEAD_KEYS)
        # The same count as the heads is already covered by their rule.
        if kv is not None and kv[1] != heads:
            out.append(
                Rule(
                    kv[0],
                    kv[1],
                    either_way=True,
                    why="vLLM splits the KV heads over the TP ranks, or copies them when there are fewer",
                )
            )
    experts = _first(model_cfg, EXPERT_KEYS)
    if experts is not None and experts[1] > 1 and not expert_parallel:
        width = _first(model_cfg, ("moe_intermediate_size", "intermediate_size"))
        if width is not None:
            out.append(
                Rule(
                    width[0],
                    width[1],
                    why=f"the width of each routed expert, {experts[0]} = {experts[1]}, which vLLM splits over "
                    "the TP ranks without expert parallelism",
                )
            )
    return out


def broken(tp: int, found: list[Rule]) -> list[Rule]:
    return [r for r in found if not r.allows(tp)]


def sizes_that_work(found: list[Rule]) -> list[int]:
    """Every TP size that fits all the rules, up to the attention heads (no larger size divides
    them), else up to MAX_LISTED."""
    heads = next((r.value for r in found if r.key == "num_attention_heads"), None)
    return [t for t in range(1, (heads or MAX_LISTED) + 1) if not broken(t, found)]
