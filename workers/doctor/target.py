"""The doctor's target checks: config.json, the weights on disk, the TP sizes its shape allows, custom code, layer ids.

Stdlib only: nothing here loads a weight or imports transformers. config.json is read as
JSON, the language model's keys from text_config when the target wraps one (Kimi-K2.5). The
weights and TP checks are state/preload.py's, which `eyas submit` and `eyas validate` run too:
a failure here reads as their refusal does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.state import preload, tpsizes
from eyas.state.runconfig import RunConfig
from eyas.state.target import layer_id_errors, text_value
from eyas.state.weightfiles import INDEX, SINGLE, WeightFiles, scan
from eyas.workers.doctor.check import Check, failed, human_bytes, passed, warned


@dataclass(frozen=True)
class TargetFacts:
    """What the other checks need to know of the target."""

    path: str
    config: dict[str, Any]
    architecture: str | None
    num_layers: int | None
    hidden_size: int | None
    vocab_size: int | None
    weight_bytes: int | None  # from the index's metadata.total_size, else the *.safetensors files' sizes
    files: WeightFiles | None = None  # the weight files (state/weightfiles.py); None: not listed


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
    try:
        files = scan(path)
    except OSError:
        files = None
    facts = TargetFacts(path, cfg, arch, n, hidden, vocab, files.size() if files else None, files)
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
    return facts, out


def weights(cfg: RunConfig, facts: TargetFacts) -> Check:
    """The weights on disk against the stages that load them (state/preload.py's rule and words)."""
    files = facts.files
    if files is None:
        return failed("target", "weights", f"{facts.path}: cannot be listed", "point target.path at a model directory")
    problem = preload.weights_problem(cfg, files)
    data = {"bytes": files.size(), "shards": len(files.shards) or len(files.safetensors), "missing": len(files.missing)}
    if problem is not None:
        return failed("target", "weights", problem.detail, problem.fix, **data)
    if not files.complete or not files.safetensors:
        dummy = [ld.stage for ld in preload.loaders(cfg)]
        why = (
            f'{" and ".join(dummy)} run{"s" if len(dummy) == 1 else ""} on dummy weights (load_format = "dummy")'
            if dummy
            else "no stage of the pipeline loads them"
        )
        return passed(
            "target", "weights", f"no complete safetensors weights in {facts.path}; not needed: {why}", **data
        )
    size = files.size()
    amount = human_bytes(size) if size else "size unknown"
    if files.has_index:
        n = len(files.shards)
        detail = f"{amount} in {n} shard{'s' if n != 1 else ''} ({INDEX})"
    elif files.safetensors == (SINGLE,):
        detail = f"{amount} in {SINGLE}"
    else:
        detail = f"{amount} in {len(files.safetensors)} *.safetensors files (no {INDEX})"
    return passed("target", "weights", detail, **data)


def tensor_parallel(cfg: RunConfig, facts: TargetFacts) -> Check | None:
    """The run's vLLM TP sizes against the target's heads, KV heads and experts (state/tpsizes.py's
    rules, state/preload.py's words); None when no stage runs vLLM."""
    settings = preload.tp_settings(cfg)
    if not settings:
        return None
    problems = preload.tp_problems(cfg, facts.config)
    if problems:
        return failed(
            "target",
            "tensor parallel",
            "; ".join(p.detail for p in problems),
            "; ".join(p.fix for p in problems),
            sizes={s.key: s.size for s in settings},
        )
    told: dict[int, list[str]] = {}
    for s in settings:
        told.setdefault(s.size, []).append(s.key)
    found = {rule.key: rule.value for s in settings for rule in tpsizes.rules(facts.config, s.expert_parallel)}
    shape = ", ".join(f"{k} = {v}" for k, v in found.items()) or "no head or expert count in config.json"
    sizes = "; ".join(f"{' and '.join(keys)} {size}" for size, keys in told.items())
    return passed(
        "target",
        "tensor parallel",
        f"{sizes} fit{'s' if len(settings) == 1 else ''} {shape}",
        sizes={s.key: s.size for s in settings},
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
