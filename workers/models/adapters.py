"""Model-family adapters: where a target keeps its text decoder, and which ids it can serve.

The layer-id convention (docs/ARCHITECTURE.md): id i < N is the residual stream entering decoder
layer i (id 0: the embeddings), id N (= num_hidden_layers) is the final pre-norm output, i.e.
what enters the final norm. So every id is the *input* of one module: layer i, or the norm.
An adapter says where those modules live; a `StreamTap` says how one backend's module inputs
carry the residual stream (transformers passes it whole; vLLM splits it into
hidden_states + residual, which its own tap adds up).

Families are keyed by the architecture name in config.json (`architectures[0]`), the name
transformers and vLLM both dispatch on. An unknown one fails before any weight is loaded.
Stdlib only at import: torch is needed only once a model exists.

Backends. The same adapter serves a transformers model (`hf`) and a vLLM model (`vllm`): the
module layout is the same (vLLM mirrors the checkpoint's names), what differs is
- how a tapped module receives the stream (`TAPS`): transformers layers take the whole
  stream; vLLM layers take `(positions, hidden_states, residual, ...)` and the stream is
  hidden_states + residual (residual None at layer 0: the embeddings alone). The vLLM tap
  finds those two parameters in the loaded layer class's own signature, never by position
  guessed from another family (speculators 0.3.0 called every layer Llama-style and broke
  on DeepseekV2DecoderLayer);
- the model API an adapter may call (`API`): transformers' `get_input_embeddings()` versus
  vLLM's `embed_input_ids(ids)`. `Decoder.api()` checks the method on the loaded class and
  fails naming it, so a wrong guess is a one-line error at start-up instead of an
  AttributeError inside a tensor-parallel worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


class UnknownArchitecture(ValueError):
    """No adapter knows this architecture."""


class AdapterMismatch(TypeError):
    """The loaded model's classes are not shaped the way the adapter expects."""


# The methods an adapter may call on a decoder, per backend and purpose.
API: dict[str, dict[str, str]] = {
    "hf": {"embed": "get_input_embeddings"},  # returns the embedding module
    "vllm": {"embed": "embed_input_ids"},  # takes input ids, returns embeddings
}

# Every method name known to serve a purpose on some backend's classes, so that a mismatch can
# name the one a class does have (a superset of API's values).
KNOWN_METHODS: dict[str, tuple[str, ...]] = {
    "embed": ("embed_input_ids", "get_input_embeddings"),
}

# The parameters of a decoder layer's forward that carry the residual stream, per backend's
# tap: transformers passes the whole stream first; vLLM splits it into hidden_states +
# residual. The taps below and `eyas doctor` (doctor/adapter.py) both read this.
STREAM_PARAMS: dict[str, tuple[str, ...]] = {
    "hf": ("hidden_states",),
    "vllm": ("hidden_states", "residual"),
}


def api_problem(cls: type, purpose: str, backend: str) -> str | None:
    """Why `cls` cannot serve `purpose` on `backend` (see API), or None when it can."""
    name = API[backend][purpose]
    if callable(getattr(cls, name, None)):
        return None
    known = set(KNOWN_METHODS.get(purpose, ())) | {api[purpose] for api in API.values()}
    others = sorted(o for o in known - {name} if callable(getattr(cls, o, None)))
    has = f"; it has {', '.join(o + '()' for o in others)}" if others else ""
    return f"'{cls.__name__}' has no {name}(), the {backend} API for {purpose}{has}"


def layer_problem(cls: type, backend: str) -> str | None:
    """Why the `backend` tap cannot read the stream entering a decoder layer of class `cls`
    (STREAM_PARAMS missing from its forward), or None when it can."""
    for name in STREAM_PARAMS[backend]:
        index = _param_index(cls.forward, name)
        if index is None:
            return _layer_mismatch(cls, name, backend)
        if backend == "hf" and index != 1:
            # _hf_stream takes a positional call's first argument as the stream.
            return (
                f"{cls.__name__}.forward{_signature(cls.forward)} does not take 'hidden_states' first: the hf "
                "tap reads the stream entering a decoder layer as its first argument; this layer class is "
                "not laid out as the adapter expects (add its family to eyas/workers/models/adapters.py)"
            )
    return None


def _layer_mismatch(cls: type, missing: str, backend: str) -> str:
    reads = "hidden_states + residual" if backend == "vllm" else "hidden_states"
    return (
        f"{cls.__name__}.forward{_signature(cls.forward)} has no '{missing}' parameter: the {backend} tap "
        f"reads the residual stream entering a decoder layer as {reads}; this layer class is not laid out "
        "as the adapter expects (add its family to eyas/workers/models/adapters.py)"
    )


def _resolve(model: Any, path: str) -> Any:
    """Follow a dotted path; a segment ending in "()" is a method to call, such as vLLM's
    `get_language_model()` on multimodal wrappers."""
    obj = model
    for part in path.split(".") if path else ():
        if part.endswith("()"):
            method = getattr(obj, part[:-2])
            obj = method()
        else:
            obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Adapter:
    family: str
    architectures: tuple[str, ...]
    # Dotted paths from the loaded model to its text decoder (the module holding `layers`
    # and `norm`), tried in order: the same family is laid out differently by
    # transformers (Llava: model.language_model) and by remote code or vLLM
    # (Kimi-K2.5: language_model.model).
    decoder_paths: tuple[str, ...]
    layers_attr: str = "layers"
    norm_attr: str = "norm"
    # More paths to try on a vLLM model, after decoder_paths.
    vllm_paths: tuple[str, ...] = ()

    def decoder(self, model: Any, backend: str = "hf") -> Decoder:
        """The text decoder of `model`: its layers, final norm and depth N."""
        paths = self.decoder_paths + (self.vllm_paths if backend == "vllm" else ())
        for path in paths:
            try:
                module = _resolve(model, path)
                layers = getattr(module, self.layers_attr)
                norm = getattr(module, self.norm_attr)
            except (AttributeError, NotImplementedError):
                continue
            # Decoders iterate layers[:num_hidden_layers]; extra entries (e.g. MTP heads)
            # are not part of the residual stream the ids count.
            n = getattr(getattr(module, "config", None), "num_hidden_layers", None) or len(layers)
            return Decoder(module=module, layers=layers, norm=norm, num_layers=min(n, len(layers)), path=path)
        where = ", ".join(f"{p}.{self.layers_attr}" if p else self.layers_attr for p in paths)
        raise UnknownArchitecture(
            f"{type(model).__name__}: no decoder layers found at {where} (adapter {self.family}); "
            "the model's layout is not the one this adapter knows"
        )


@dataclass(frozen=True)
class Decoder:
    """A resolved text decoder. Calling `module` runs the embeddings, every layer and the norm."""

    module: Any
    layers: Any
    norm: Any
    num_layers: int
    path: str

    def check_ids(self, layer_ids: Iterable[int]) -> tuple[int, ...]:
        ids = tuple(layer_ids)
        n = self.num_layers
        bad = [i for i in ids if not (isinstance(i, int) and 0 <= i <= n)]
        if bad:
            raise ValueError(
                f"layer id {bad[0]} is out of range for a {n}-layer target: "
                f"use ids from 0 to {n} ({n} is the final pre-norm output)"
            )
        if len(set(ids)) != len(ids) or not ids:
            raise ValueError(f"layer ids {list(ids)}: list each id once, at least one")
        return ids

    def tap_module(self, layer_id: int) -> Any:
        """The module whose input is the residual stream of `layer_id`."""
        return self.layers[layer_id] if layer_id < self.num_layers else self.norm

    def api(self, purpose: str, backend: str) -> Callable:
        """The decoder's own method for `purpose` on `backend` (see API), checked on the
        loaded class: a missing one fails naming the class and the method."""
        problem = api_problem(type(self.module), purpose, backend)
        if problem:
            raise AdapterMismatch(problem)
        return getattr(self.module, API[backend][purpose])

    @staticmethod
    def meaning(layer_id: int, n: int) -> str:
        if layer_id == 0:
            return "embeddings: the residual stream entering decoder layer 0"
        if layer_id < n:
            return f"the residual stream entering decoder layer {layer_id}"
        return f"the final pre-norm output: the output of decoder layer {n - 1}, before the final norm"


@dataclass(frozen=True)
class StreamTap:
    """How a backend's tapped modules receive the residual stream: (args, kwargs) -> tensor.

    `bind(module)` gives the reader for one module; a backend whose modules differ in
    signature (vLLM) inspects each module there, once, rather than on every call.
    """

    backend: str
    read: Callable[[tuple, dict], Any]
    binder: Callable[[Any], Callable[[tuple, dict], Any]] | None = None

    def bind(self, module: Any) -> Callable[[tuple, dict], Any]:
        return self.binder(module) if self.binder is not None else self.read


def _hf_stream(args: tuple, kwargs: dict) -> Any:
    # transformers 5.x decoder layers and norms take the whole stream as `hidden_states`,
    # positionally or by keyword; a layer returns a tensor, not (hidden, residual).
    return args[0] if args else kwargs["hidden_states"]


def _param_index(fn: Callable, name: str) -> int | None:
    """Positional index of parameter `name` in `fn`'s signature (self excluded), or None."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == name and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return i
    return None


def _arg(args: tuple, kwargs: dict, index: int | None, name: str) -> Any:
    if index is not None and index < len(args):
        return args[index]
    return kwargs.get(name)


def _vllm_binder(module: Any) -> Callable[[tuple, dict], Any]:
    """The stream entering a vLLM decoder layer or final norm: hidden_states + residual.

    vLLM layers are called `layer(positions, hidden_states, residual, ...)` and norms
    `norm(x, residual)`; which argument is which comes from the loaded class's signature.
    vLLM's norm is a CustomOp whose forward takes *args, so a norm's stream is its first
    two arguments (x, residual), as vLLM itself calls it.
    """
    cls = type(module)
    hname, rname = STREAM_PARAMS["vllm"]
    h = _param_index(cls.forward, hname)
    r = _param_index(cls.forward, rname)
    if h is not None and r is not None:
        # Signature indices count `self`; the hook's args do not.
        h, r = h - 1, r - 1
    elif h is None and r is None and _is_norm(module):
        h, r, hname, rname = 0, 1, "x", "residual"
    else:
        raise AdapterMismatch(layer_problem(cls, "vllm"))

    def read(args: tuple, kwargs: dict) -> Any:
        hidden = _arg(args, kwargs, h, hname)
        residual = _arg(args, kwargs, r, rname)
        # Layer 0 gets residual None: its stream is the embeddings alone.
        return hidden if residual is None else hidden + residual

    return read


def _is_norm(module: Any) -> bool:
    return "norm" in type(module).__name__.lower()


def _signature(fn: Callable) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


HF_TAP = StreamTap("hf", _hf_stream)
VLLM_TAP = StreamTap("vllm", _hf_stream, _vllm_binder)
TAPS = {"hf": HF_TAP, "vllm": VLLM_TAP}

ADAPTERS: tuple[Adapter, ...] = (
    Adapter(
        "llama",
        ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        ("model",),
    ),
    Adapter("deepseek_v3", ("DeepseekV3ForCausalLM",), ("model",)),
    # Multimodal wrappers run text-only here: the decoder is called directly, so no vision
    # tower runs. transformers 5.x puts the decoder at model.language_model; Kimi-K2.5's
    # remote code (and vLLM) at language_model.model; vLLM wrappers also answer
    # get_language_model(), tried last, on that backend only.
    Adapter(
        "multimodal",
        (
            "KimiK25ForConditionalGeneration",
            "LlavaForConditionalGeneration",
            "Mistral3ForConditionalGeneration",
            "Qwen2_5_VLForConditionalGeneration",
            "Qwen3VLForConditionalGeneration",
        ),
        ("language_model.model", "model.language_model", "language_model"),
        vllm_paths=("get_language_model().model",),
    ),
)

_BY_ARCH = {arch: a for a in ADAPTERS for arch in a.architectures}


def known_architectures() -> list[str]:
    return sorted(_BY_ARCH)


def adapter_for(architecture: str) -> Adapter:
    try:
        return _BY_ARCH[architecture]
    except KeyError:
        raise UnknownArchitecture(
            f"architecture {architecture!r} is not supported for extraction; known: "
            f"{', '.join(known_architectures())} (add an adapter in eyas/workers/models/adapters.py)"
        ) from None


def architecture_of(model_config: dict[str, Any]) -> str:
    """The architecture named by a config.json dict (its first `architectures` entry)."""
    archs = model_config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise UnknownArchitecture(
            'config.json names no architectures; set "architectures": ["<ClassName>"], one of '
            f"{', '.join(known_architectures())}"
        )
    return archs[0]


def resolve(model: Any, architecture: str | None = None, backend: str = "hf") -> tuple[Adapter, Decoder]:
    """The adapter and decoder of a loaded model (architecture: its class name by default)."""
    adapter = adapter_for(architecture or type(model).__name__)
    return adapter, adapter.decoder(model, backend)
