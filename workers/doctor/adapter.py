"""The doctor's adapter fit: does eyas's adapter match the backend's model classes?

The architecture resolves to its adapter (models/adapters.py), then to the backend's class: vLLM's,
through vLLM's model registry; transformers', as models/hf_target.py loads it. No model is built:
models/classwalk.py reads the classes' __init__ to follow the adapter's decoder paths through any
wrapper. Then the expectations adapters.py holds as data are checked on the classes found:
the embedding method (adapters.API via api_problem) and the decoder layer's forward
(adapters.STREAM_PARAMS via layer_problem), the same functions the extract stage runs on
the loaded model. So a wrong expectation fails here in seconds, with a fix, instead of in a
tensor-parallel worker after the weights have loaded.

vLLM's classes are first read from its source files without importing vLLM (the stand-ins of
vllmsource.py: a second instead of the 5-10 s that importing a model module takes, most of the
doctor's time). When every check passes on them, that is the answer; any other
outcome is found again on the real classes through vLLM's registry, so each failure and its
wording are the real classes'. What the source cannot tell is whether the model module
imports on this machine (a vLLM-CPU host without torchvision cannot import Qwen-VL's): the
canary (`eyas doctor --canary`, and the preflight stage) runs the engine and finds that.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

from eyas.workers.doctor.check import Check, failed, passed, warned
from eyas.workers.doctor.target import TargetFacts
from eyas.workers.doctor.vllmsource import TORCH_MODULES, static_vllm
from eyas.workers.models import adapters, classwalk

GROUP = "adapter"
# resolve_model_cls reads only these of a ModelConfig for an architecture it has registered
# (vLLM 0.32 and 0.33): a full ModelConfig would parse the checkpoint and need a tokenizer.
_REGISTRY_ONLY = SimpleNamespace(model_impl="auto", runner_type="generate", convert_type="none")


def vllm_class(arch: str) -> type | None:
    """vLLM's model class for `arch` through its registry (imports the model's module only)."""
    from vllm import ModelRegistry

    if arch not in ModelRegistry.get_supported_archs():
        return None
    cls, _ = ModelRegistry.resolve_model_cls([arch], model_config=_REGISTRY_ONLY)
    return cls


def _vllm_reader() -> classwalk.ClassReader:
    from torch import nn

    def resolve(archs: list[str]) -> type | None:
        for arch in archs:
            cls = vllm_class(arch)
            if cls is not None:
                return cls
        return None

    return classwalk.ClassReader(nn.Module, (nn.ModuleList, nn.ModuleDict, nn.Sequential), resolve)


def _hf_reader() -> classwalk.ClassReader:
    from torch import nn

    return classwalk.ClassReader(nn.Module, (nn.ModuleList, nn.ModuleDict, nn.Sequential))


def hf_class(facts: TargetFacts, trust_remote_code: bool) -> tuple[type | None, str]:
    """transformers' class for the target as hf_target.load picks it: built in, else the
    checkpoint's own code through its auto_map (only with trust_remote_code)."""
    import transformers

    arch = facts.architecture
    cls = getattr(transformers, arch, None)
    if isinstance(cls, type):
        return cls, ""
    if not trust_remote_code:
        return None, (
            f"transformers {transformers.__version__} has no {arch}, and the checkpoint's own code "
            "runs only with target.trust_remote_code = true"
        )
    auto = facts.config.get("auto_map") if isinstance(facts.config.get("auto_map"), dict) else {}
    ref = next(
        (auto[k] for k in ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModel") if k in auto), None
    )
    if not isinstance(ref, str):
        return None, f"transformers has no {arch} and config.json's auto_map names no model class"
    module_file = Path(facts.path) / (ref.split("--")[-1].rsplit(".", 1)[0] + ".py")
    if not module_file.exists():
        return None, (
            f"transformers has no {arch}, and the custom code it names ({module_file.name}) is not in {facts.path}"
        )
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    try:
        return get_class_from_dynamic_module(ref, facts.path), ""
    except Exception as exc:  # noqa: BLE001 - remote code may raise anything on import
        return None, f"importing {ref} from {facts.path} failed ({type(exc).__name__}: {exc})"


def check(facts: TargetFacts, backend: str, trust_remote_code: bool) -> list[Check]:
    arch = facts.architecture
    try:
        adapter = adapters.adapter_for(arch or "")
    except adapters.UnknownArchitecture:
        return [
            failed(
                GROUP,
                "architecture",
                f"no eyas adapter for {arch}",
                f"add an adapter for {arch} in eyas/workers/models/adapters.py (known: "
                f"{', '.join(adapters.known_architectures())})",
            )
        ]
    if backend == "vllm":
        fast = _static_checks(facts, adapter)
        if fast is not None:
            return fast
        try:
            top = vllm_class(arch)
        except Exception as exc:  # noqa: BLE001 - a model module that fails to import is the finding
            return [
                failed(
                    GROUP,
                    "architecture",
                    f"vLLM's class for {arch} does not import ({type(exc).__name__}: {exc})",
                    'fix the vLLM install (see versions above), or use extract.backend = "hf"',
                )
            ]
        if top is None:
            return [
                failed(
                    GROUP,
                    "architecture",
                    f"vLLM's model registry has no {arch}",
                    'use extract.backend = "hf", or a vLLM release that supports it',
                )
            ]
        reader, paths = _vllm_reader(), adapter.decoder_paths + adapter.vllm_paths
    else:
        top, why = hf_class(facts, trust_remote_code)
        if top is None:
            fix = (
                "set target.trust_remote_code = true"
                if not trust_remote_code
                else "put the checkpoint's modelling code beside config.json"
            ) + ', or use extract.backend = "vllm"'
            return [failed(GROUP, "architecture", why, fix)]
        reader, paths = _hf_reader(), adapter.decoder_paths
    return _checks(reader, top, paths, adapter, arch, backend)


def _checks(
    reader: classwalk.ClassReader, top: type, paths: tuple[str, ...], adapter: adapters.Adapter, arch: str, backend: str
) -> list[Check]:
    """The architecture, decoder, embedding and layer-forward checks on `top`, the backend's class."""
    out = [
        passed(
            GROUP,
            "architecture",
            f"{arch} -> adapter '{adapter.family}'; {backend} class {top.__module__}.{top.__qualname__}",
            family=adapter.family,
            model_class=top.__name__,
        )
    ]
    decoder, layer, check_ = _decoder(reader, top, paths, adapter)
    out.append(check_)
    if decoder is None:
        return out
    out.append(embedding(decoder, backend))
    if layer is not None:
        out.append(layer_forward(layer, backend))
    return out


def _decoder(reader: classwalk.ClassReader, top: type, paths: tuple[str, ...], adapter: adapters.Adapter):
    """(decoder class, layer class, Check): the first path that reaches a class assigning
    both the layers and the norm, as Adapter.decoder takes the first that resolves."""
    reasons, unknown = [], False
    for path in paths:
        found = classwalk.path_class(reader, top, path)
        if not found.ok:
            unknown = unknown or found.state == classwalk.UNKNOWN
            reasons.append(f"{path or '<top>'}: {found.how}")
            continue
        cls = found.cls
        missing = [a for a in (adapter.layers_attr, adapter.norm_attr) if not reader.assigns(cls, a)]
        if missing:
            reasons.append(f"{path}: {cls.__name__} assigns no {' nor '.join(missing)}")
            continue
        layer = reader.element(cls, adapter.layers_attr)
        norm = reader.attr(cls, adapter.norm_attr)
        where = f"{top.__name__}.{path}" if path else top.__name__
        detail = (
            f"{where} -> {cls.__name__}: {adapter.layers_attr} of "
            f"{layer.cls.__name__ if layer.ok else '?'}, {adapter.norm_attr} "
            f"{norm.cls.__name__ if norm.ok else '?'}"
        )
        return (
            cls,
            layer.cls if layer.ok else None,
            passed(
                GROUP,
                "decoder",
                detail,
                path=path,
                decoder_class=cls.__name__,
                layer_class=layer.cls.__name__ if layer.ok else None,
            ),
        )
    tried = ", ".join(p or "<top>" for p in paths)
    if unknown:
        return (
            None,
            None,
            warned(
                GROUP,
                "decoder",
                f"cannot tell from {top.__name__}'s source where its decoder is ({'; '.join(reasons)})",
                "nothing to do unless extract then fails to find "
                f"it; if so, add the path to the '{adapter.family}' adapter in "
                "eyas/workers/models/adapters.py",
                tried=list(paths),
            ),
        )
    return (
        None,
        None,
        failed(
            GROUP,
            "decoder",
            f"{top.__name__} has no decoder at {tried} ({'; '.join(reasons)})",
            f"add the path to {top.__name__}'s decoder (the module holding "
            f"{adapter.layers_attr} and {adapter.norm_attr}) to the '{adapter.family}' adapter's "
            "decoder_paths in eyas/workers/models/adapters.py",
            tried=list(paths),
        ),
    )


def embedding(decoder: type, backend: str) -> Check:
    """The embedding method the backend's adapter calls, e.g. "DeepseekV2Model has
    embed_input_ids, no get_input_embeddings"."""
    expected = adapters.API[backend]["embed"]
    known = set(adapters.KNOWN_METHODS["embed"]) | {api["embed"] for api in adapters.API.values()}
    names = [expected, *sorted(known - {expected})]
    has = [n for n in names if callable(getattr(decoder, n, None))]
    lacks = [n for n in names if n not in has]
    found = f"{decoder.__name__} has {', '.join(has) or 'none of ' + ', '.join(names)}" + (
        f", no {', '.join(lacks)}" if has and lacks else ""
    )
    problem = adapters.api_problem(decoder, "embed", backend)
    data = {"decoder_class": decoder.__name__, "expects": expected, "has": has}
    if problem is None:
        return passed(GROUP, "embedding", f"{found}: the {backend} adapter calls {expected}()", **data)
    if has:
        fix = (
            f"make the {backend} adapter call {has[0]}(): set API['{backend}']['embed'] = '{has[0]}' in "
            "eyas/workers/models/adapters.py"
        )
    else:
        fix = f"add {decoder.__name__}'s embedding method to API['{backend}'] in eyas/workers/models/adapters.py"
    return failed(GROUP, "embedding", f"{found}: the {backend} adapter calls {expected}()", fix, **data)


def layer_forward(layer: type, backend: str) -> Check:
    """The decoder layer's forward against what the backend's tap reads (adapters.STREAM_PARAMS)."""
    params = adapters.STREAM_PARAMS[backend]
    try:
        # Names only: the annotations make a line nobody reads.
        sig = f"({', '.join(inspect.signature(layer.forward).parameters)})"
    except (TypeError, ValueError):
        sig = "(...)"
    problem = adapters.layer_problem(layer, backend)
    data = {"layer_class": layer.__name__, "signature": sig, "needs": list(params)}
    if problem is None:
        return passed(
            GROUP,
            "layer forward",
            f"{layer.__name__}.forward{sig}: the {backend} tap reads {' + '.join(params)}",
            **data,
        )
    return failed(
        GROUP,
        "layer forward",
        problem.split("; this layer class")[0],
        f"add {layer.__name__}'s family to eyas/workers/models/adapters.py: the {backend} tap needs "
        f"{' and '.join(params)} in the decoder layer's forward",
        **data,
    )


def _static_checks(facts: TargetFacts, adapter: adapters.Adapter) -> list[Check] | None:
    """The vllm adapter checks on the stand-in classes: the list when every one passes, else None."""
    try:
        reader_vllm = static_vllm()
        top = reader_vllm.resolve([facts.architecture]) if reader_vllm is not None else None
        if not isinstance(top, type):
            return None
        nn = TORCH_MODULES
        reader = classwalk.ClassReader(
            nn["torch.nn.Module"],
            (nn["torch.nn.ModuleList"], nn["torch.nn.ModuleDict"], nn["torch.nn.Sequential"]),
            reader_vllm.resolve,
        )
        out = _checks(reader, top, adapter.decoder_paths + adapter.vllm_paths, adapter, facts.architecture, "vllm")
    except Exception:  # noqa: BLE001 - whatever the stand-ins cannot read, the real classes are read
        return None
    return out if all(c.verdict == "pass" for c in out) else None
