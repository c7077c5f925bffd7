"""The doctor's target checks: config.json, the safetensors index, custom code, layer ids.

Stdlib only: nothing here loads a weight or imports transformers. config.json is read as
JSON, the language model's keys from text_config when the target wraps one (Kimi-K2.5).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.state.target import layer_id_errors, text_value
from eyas.workers.doctor.check import Check, failed, human_bytes, passed, warned

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class TargetFacts:
    """What the other checks need to know of the target."""

    path: str
    config: dict[str, Any]
    architecture: str | None
    num_layers: int | None
    hidden_size: int | None
    vocab_size: int | None
    weight_bytes: int | None  # from the index's metadata.total_size, or the single file's size


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def read(path: str) -> tuple[TargetFacts | None, list[Check]]:
    """Read config.json and the weights' index; checks for what is missing or malformed."""
    out: list[Check] = []
    cfg_path = Path(path) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        out.append(
            failed(
                "target",
                "config.json",
                f"{cfg_path}: unreadable ({exc})",
                "point target.path at a model directory with a valid config.json",
            )
        )
        return None, out
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    n = _int(text_value(cfg, "num_hidden_layers"))
    hidden = _int(text_value(cfg, "hidden_size"))
    vocab = _int(text_value(cfg, "vocab_size"))
    model_type = cfg.get("model_type")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
    missing = [
        k
        for k, v in (("architectures", arch), ("num_hidden_layers", n), ("hidden_size", hidden), ("vocab_size", vocab))
        if v is None
    ]
    weights, index_check = _weights(Path(path))
    facts = TargetFacts(path, cfg, arch, n, hidden, vocab, weights)
    shape = (
        f"{arch or '?'} ({model_type or 'no model_type'}"
        + (f", text model {text.get('model_type')}" if text and text.get("model_type") else "")
        + f"): {n or '?'} layers, hidden {hidden or '?'}, vocab {vocab or '?'}"
    )
    data = {
        "architecture": arch,
        "model_type": model_type,
        "num_hidden_layers": n,
        "hidden_size": hidden,
        "vocab_size": vocab,
    }
    if missing:
        out.append(
            failed(
                "target",
                "config.json",
                f"{shape}; no {', '.join(missing)}",
                f"add {', '.join(missing)} to {cfg_path} (or its text_config), or use the model's original config.json",
                **data,
            )
        )
    else:
        out.append(passed("target", "config.json", shape, **data))
    out.append(index_check)
    return facts, out


def _weights(path: Path) -> tuple[int | None, Check]:
    index = path / INDEX
    if index.exists():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
            total = data["metadata"]["total_size"]
            shards = sorted(set(data["weight_map"].values()))
            if not _int(total):
                raise ValueError(f"metadata.total_size is {total!r}")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return None, failed(
                "target",
                "weights",
                f"{index}: unusable ({type(exc).__name__}: {exc})",
                "restore the checkpoint's original model.safetensors.index.json",
            )
        absent = [s for s in shards if not (path / s).exists()]
        detail = f"{human_bytes(total)} in {len(shards)} shard{'s' if len(shards) != 1 else ''} ({INDEX})"
        if absent:
            return total, warned(
                "target",
                "weights",
                f"{detail}; {len(absent)} shard(s) missing, e.g. {absent[0]}",
                "finish downloading the checkpoint (every file the index names)",
                bytes=total,
                shards=len(shards),
                missing=len(absent),
            )
        return total, passed("target", "weights", detail, bytes=total, shards=len(shards), missing=0)
    single = path / SINGLE
    if single.exists():
        size = single.stat().st_size
        return size, passed("target", "weights", f"{human_bytes(size)} in {SINGLE}", bytes=size, shards=1, missing=0)
    return None, warned(
        "target",
        "weights",
        f"no {INDEX} nor {SINGLE} in {path}: the weights' size is unknown",
        "point target.path at a safetensors checkpoint (memory needs are then checked too)",
    )


def remote_code(facts: TargetFacts, trust_remote_code: bool) -> Check:
    """An auto_map (config.json or tokenizer_config.json) means the checkpoint ships its own
    code, which transformers runs only with trust_remote_code."""
    maps = {}
    for name in ("config.json", "tokenizer_config.json"):
        try:
            data = (
                facts.config
                if name == "config.json"
                else json.loads((Path(facts.path) / name).read_text(encoding="utf-8"))
            )
        except (OSError, ValueError):
            continue
        auto = data.get("auto_map") if isinstance(data, dict) else None
        if isinstance(auto, dict) and auto:
            maps[name] = auto
    if not maps:
        if trust_remote_code:
            return passed(
                "target", "trust_remote_code", "set, though no auto_map names custom code (not needed)", auto_map=False
            )
        return passed("target", "trust_remote_code", "not needed: no auto_map (no custom code)", auto_map=False)
    files = sorted({_module_file(ref) for auto in maps.values() for ref in _refs(auto)})
    where = ", ".join(f"{name} auto_map ({', '.join(sorted(auto))})" for name, auto in maps.items())
    detail = f"{where} names custom code in {', '.join(files)}"
    if trust_remote_code:
        return passed("target", "trust_remote_code", f"set; {detail}", auto_map=True, files=files)
    return failed(
        "target",
        "trust_remote_code",
        f"not set, but {detail}",
        "set target.trust_remote_code = true (after reading that code: it runs in every rank)",
        auto_map=True,
        files=files,
    )


def _refs(auto: dict) -> list[str]:
    refs = []
    for value in auto.values():
        refs.extend(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str))
    return refs


def _module_file(ref: str) -> str:
    """ "configuration_kimi.KimiConfig" -> "configuration_kimi.py" (a "repo--module.Class" too)."""
    return ref.split("--")[-1].rsplit(".", 1)[0] + ".py"


def explain_layer_ids(ids: tuple[int, ...] | list[int], n: int) -> str:
    """The ids in plain words: "ids 2, 30, 58 are the inputs of layers 2, 30, 58; id 61 is the
    final pre-norm output" (the convention in docs/ARCHITECTURE.md)."""
    inner = [i for i in ids if 0 < i < n]
    parts = []
    if 0 in ids:
        parts.append("id 0 is the embeddings (the input of layer 0)")
    if inner:
        joined = ", ".join(map(str, inner))
        parts.append(
            f"ids {joined} are the inputs of layers {joined}"
            if len(inner) > 1
            else f"id {joined} is the input of layer {joined}"
        )
    if n in ids:
        parts.append(f"id {n} is the final pre-norm output (layer {n - 1}'s output, before the final norm)")
    return "; ".join(parts)


def layer_ids(ids: Any, n: int | None, defaulted: bool) -> Check:
    """The run's layer ids against the target's depth: range, duplicates, order."""
    if n is None:
        return warned(
            "layer ids",
            "layer ids",
            f"{ids}: the target's depth is unknown",
            "give config.json a num_hidden_layers so the ids can be checked",
        )
    ids = list(ids) if isinstance(ids, tuple) else ids  # as TOML wrote it (a list, or a wrong type)
    errors = layer_id_errors(ids, n)
    if errors:
        problem, _, fix = errors[0].partition("; ")
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return failed(
            "layer ids",
            "layer ids",
            f"extract.layer_ids {ids}: {problem}{more}",
            fix or "list ids from 0 to N, ascending, once each",
            ids=ids,
            num_layers=n,
            errors=errors,
        )
    source = "default for" if defaulted else "for"
    return passed(
        "layer ids",
        "layer ids",
        f"{list(ids)} ({source} {n} layers): {explain_layer_ids(ids, n)}",
        ids=list(ids),
        num_layers=n,
    )
