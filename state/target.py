"""What eyas reads of a target model's config.json (its depth, its text model's keys) and the rules for the layer ids an EAGLE-3 draft fuses from it.

Read with `json`, not transformers: the daemon and `eyas validate` use this and load no engine.
Layer ids follow vLLM and speculators: id i < N is the residual stream entering decoder layer
i, and id N (num_hidden_layers) is the final pre-norm output.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eyas.state.tomlcheck import describe, is_int


def layer_id_errors(value: Any, n: int | None) -> list[str]:
    """What is wrong with a list of layer ids for an `n`-layer target (None: depth unknown), one
    "problem; fix" line each; [] when nothing is."""
    if not isinstance(value, (list, tuple)):
        return [f"expected an array of layer ids, got {describe(value)}"]
    bad = [v for v in value if not is_int(v)]
    if bad:
        return [f"expected integers, got {describe(bad[0])}"]
    errors = []
    if len(value) < 2:
        errors.append(f"{len(value)} id given; list at least 2 (EAGLE-3 fuses several layers), e.g. [2, N//2, N-3, N]")
    for v in value:
        if n is not None and not 0 <= v <= n:
            errors.append(
                f"{v} is out of range 0..{n} for a {n}-layer target; "
                f"use ids from 0 to {n} ({n} is the final pre-norm output)"
            )
        elif v < 0:
            errors.append(f"{v} is out of range; layer ids count from 0")
    # The suggested fix keeps only the ids that are in range.
    fixed = sorted({v for v in value if v >= 0 and (n is None or v <= n)})
    seen = set()
    for v in value:
        if v in seen:
            errors.append(f"{v} is listed twice; list each id once, e.g. {fixed}")
        seen.add(v)
    if len(seen) == len(value) and list(value) != sorted(value):
        errors.append(f"{list(value)} is not in ascending order; write {fixed}")
    return errors


def default_layer_ids(n: int) -> tuple[int, ...]:
    """[2, N//2, N-3, N] (EAGLE-3's low, middle, high layers plus the last hidden state),
    clipped to 0..N and deduplicated so that shallow test targets still get a valid list."""
    return tuple(sorted({min(max(i, 0), n) for i in (2, n // 2, n - 3, n)}))


def read_model_config(target_path: str | os.PathLike) -> dict[str, Any]:
    """The target's config.json as a dict (OSError / json.JSONDecodeError on a bad file)."""
    with open(Path(target_path) / "config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ValueError("config.json does not hold a JSON object")
    return cfg


def text_value(model_cfg: dict[str, Any], key: str) -> Any:
    """`key` of the language model: multimodal wrappers (e.g. KimiK25ForConditionalGeneration)
    keep it under text_config."""
    if key in model_cfg:
        return model_cfg[key]
    text = model_cfg.get("text_config")
    return text.get(key) if isinstance(text, dict) else None


def num_hidden_layers(target_path: str | os.PathLike) -> int:
    """The target's decoder depth N, from config.json (or its text_config)."""
    n = text_value(read_model_config(target_path), "num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError("config.json has no num_hidden_layers (nor text_config.num_hidden_layers)")
    return n
