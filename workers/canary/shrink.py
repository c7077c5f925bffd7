"""A shrunken copy of a target's config.json that keeps its model class path, and the map of the run's layer ids onto it.

The canary (canary/run.py) loads this copy with dummy weights in place of the target. What
decides which code runs is kept: `architectures`, `model_type`, `auto_map`, the attention
shape (hidden size, heads, MLA ranks), the vocabulary, dtype and `quantization_config`. What
only multiplies the weights is cut: the number of decoder layers and of routed experts.
Intermediate sizes are kept on purpose: quantization schemes (fp8 blocks, int4 groups)
constrain them per TP rank, and a size the target never had could fail where the target
would not.

Layer ids (ids as in state/target.py: id i enters layer i, id N is the final pre-norm output)
map by order, not by proportion: 0 stays 0, N becomes the canary's depth N', and the run's
j-th id strictly between them reads the canary's layer j. So the canary has one layer more
than the run has inner ids (at least two, and enough to hold a dense layer before the first
MoE layer), every capture point is distinct, and the order of the ids is kept.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

# Routed-expert counts under the names the model families use.
EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")
# The fewest experts the canary keeps: enough that routing picks among several, so the MoE
# kernels run as they do on the target.
MIN_EXPERTS = 8
# Per-layer lists some families carry (layer_types, sliding-window patterns, ...) are cut to
# the canary's depth: any list whose length is the target's depth.


@dataclass
class Shrunk:
    """The canary's config.json and what changed, said in words for the report."""

    config: dict[str, Any]
    num_layers: int  # the target's depth N
    canary_layers: int  # the canary's depth N'
    layer_ids: tuple[int, ...]  # the run's ids
    canary_ids: tuple[int, ...]  # the same ids on the canary
    changes: dict[str, list] = field(default_factory=dict)  # key -> [target's value, canary's]

    def as_json(self) -> dict[str, Any]:
        return {
            "layers": [self.num_layers, self.canary_layers],
            "layer_ids": {"run": list(self.layer_ids), "canary": list(self.canary_ids), "rule": MAP_RULE},
            "changes": self.changes,
        }


MAP_RULE = "0 stays 0, N becomes the canary's depth, the j-th id between them reads canary layer j"


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's table: text_config for multimodal wrappers (Kimi-K2.5), else the top."""
    inner = cfg.get("text_config")
    return inner if isinstance(inner, dict) and "num_hidden_layers" in inner else cfg


def canary_depth(layer_ids: tuple[int, ...], n: int, first_dense: int = 0) -> int:
    """How many layers the canary keeps for these ids on an n-layer target."""
    inner = len({i for i in layer_ids if 0 < i < n})
    need = max(2, inner + 1, first_dense + 1)
    return min(n, need)


def map_layer_ids(layer_ids: tuple[int, ...], n: int, depth: int) -> tuple[int, ...]:
    """The run's ids on a `depth`-layer canary of an n-layer target (see the module docstring)."""
    inner = sorted({i for i in layer_ids if 0 < i < n})
    where = {i: j + 1 for j, i in enumerate(inner)}
    where[0], where[n] = 0, depth
    return tuple(where[i] for i in layer_ids)


def shrink(cfg: dict[str, Any], layer_ids: tuple[int, ...]) -> Shrunk:
    """The canary's copy of `cfg` for a run that captures `layer_ids`."""
    out = copy.deepcopy(cfg)
    text = text_config(out)
    n = text.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError("config.json has no num_hidden_layers (nor text_config.num_hidden_layers)")
    changes: dict[str, list] = {}

    def change(key: str, value: Any) -> None:
        if text.get(key) != value:
            changes[key] = [text.get(key), value]
            text[key] = value

    experts_key = next((k for k in EXPERT_KEYS if isinstance(text.get(k), int) and text[k] > 0), None)
    # DeepSeek-style: the first k layers are dense, the rest MoE. Keep one dense layer when the
    # target has any, so both layer classes run.
    first_dense = text.get("first_k_dense_replace")
    dense = min(first_dense, 1) if experts_key and isinstance(first_dense, int) and first_dense > 0 else 0
    depth = canary_depth(tuple(layer_ids), n, dense)
    for key, value in list(text.items()):
        if isinstance(value, list) and len(value) == n and depth < n:
            change(key, value[:depth])
    change("num_hidden_layers", depth)
    if dense:
        change("first_k_dense_replace", dense)
    if experts_key:
        top_k = next((text[k] for k in TOP_K_KEYS if isinstance(text.get(k), int)), 1)
        experts = min(text[experts_key], max(MIN_EXPERTS, top_k))
        cut = experts < text[experts_key]
        change(experts_key, experts)
        # Grouped routing (DeepSeek-V3: n_group 8, topk_group 4) needs the experts split into
        # groups with enough in each for top_k; with fewer experts one group routes over all.
        if cut and isinstance(text.get("n_group"), int) and text["n_group"] > 1:
            change("n_group", 1)
            change("topk_group", 1)
    return Shrunk(out, n, depth, tuple(layer_ids), map_layer_ids(tuple(layer_ids), n, depth), changes)
