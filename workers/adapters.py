"""Model-family adapters: where a target keeps its text decoder, and which ids it can serve.

The layer-id convention (ARCHITECTURE.md): id i < N is the residual stream entering decoder
layer i (id 0: the embeddings), id N (= num_hidden_layers) is the final pre-norm output, i.e.
what enters the final norm. So every id is the *input* of one module: layer i, or the norm.
An adapter says where those modules live; a `StreamTap` says how one backend's module inputs
carry the residual stream (transformers passes it whole; vLLM splits it into
hidden_states + residual, which its own tap adds up).

Families are keyed by the architecture name in config.json (`architectures[0]`), the name
transformers and vLLM both dispatch on. An unknown one fails before any weight is loaded.
Stdlib only at import: torch is needed only once a model exists.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


class UnknownArchitecture(ValueError):
    """No adapter knows this architecture."""


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

    def decoder(self, model: Any) -> Decoder:
        """The text decoder of `model`: its layers, final norm and depth N."""
        for path in self.decoder_paths:
            try:
                module = operator.attrgetter(path)(model) if path else model
                layers = getattr(module, self.layers_attr)
                norm = getattr(module, self.norm_attr)
            except AttributeError:
                continue
            # Decoders iterate layers[:num_hidden_layers]; extra entries (e.g. MTP heads)
            # are not part of the residual stream the ids count.
            n = getattr(getattr(module, "config", None), "num_hidden_layers", None) or len(layers)
            return Decoder(module=module, layers=layers, norm=norm, num_layers=min(n, len(layers)),
                           path=path)
        where = ", ".join(f"{p}.{self.layers_attr}" if p else self.layers_attr for p in self.decoder_paths)
        raise UnknownArchitecture(
            f"{type(model).__name__}: no decoder layers found at {where} (adapter {self.family}); "
            "the model's layout is not the one this adapter knows")


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
            raise ValueError(f"layer id {bad[0]} is out of range for a {n}-layer target: "
                             f"use ids from 0 to {n} ({n} is the final pre-norm output)")
        if len(set(ids)) != len(ids) or not ids:
            raise ValueError(f"layer ids {list(ids)}: list each id once, at least one")
        return ids

    def tap_module(self, layer_id: int) -> Any:
        """The module whose input is the residual stream of `layer_id`."""
        return self.layers[layer_id] if layer_id < self.num_layers else self.norm

    @staticmethod
    def meaning(layer_id: int, n: int) -> str:
        if layer_id == 0:
            return "embeddings: the residual stream entering decoder layer 0"
        if layer_id < n:
            return f"the residual stream entering decoder layer {layer_id}"
        return f"the final pre-norm output: the output of decoder layer {n - 1}, before the final norm"


@dataclass(frozen=True)
class StreamTap:
    """How a backend's tapped modules receive the residual stream: (args, kwargs) -> tensor."""

    backend: str
    read: Callable[[tuple, dict], Any]


def _hf_stream(args: tuple, kwargs: dict) -> Any:
    # transformers 5.x decoder layers and norms take the whole stream as `hidden_states`,
    # positionally or by keyword; a layer returns a tensor, not (hidden, residual).
    return args[0] if args else kwargs["hidden_states"]


HF_TAP = StreamTap("hf", _hf_stream)
TAPS = {"hf": HF_TAP}

ADAPTERS: tuple[Adapter, ...] = (
    Adapter("llama", ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                      "Qwen3MoeForCausalLM"), ("model",)),
    Adapter("deepseek_v3", ("DeepseekV3ForCausalLM",), ("model",)),
    # Multimodal wrappers run text-only here: the decoder is called directly, so no vision
    # tower runs. transformers 5.x puts the decoder at model.language_model; Kimi-K2.5's
    # remote code (and vLLM) at language_model.model.
    Adapter("multimodal", ("KimiK25ForConditionalGeneration", "LlavaForConditionalGeneration",
                           "Mistral3ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                           "Qwen3VLForConditionalGeneration"),
            ("language_model.model", "model.language_model", "language_model")),
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
            f"{', '.join(known_architectures())} (add an adapter in eyas/workers/adapters.py)") from None


def architecture_of(model_config: dict[str, Any]) -> str:
    """The architecture named by a config.json dict (its first `architectures` entry)."""
    archs = model_config.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise UnknownArchitecture(
            "config.json names no architectures; set \"architectures\": [\"<ClassName>\"], one of "
            f"{', '.join(known_architectures())}")
    return archs[0]


def resolve(model: Any, architecture: str | None = None) -> tuple[Adapter, Decoder]:
    """The adapter and decoder of a loaded model (architecture: its class name by default)."""
    adapter = adapter_for(architecture or type(model).__name__)
    return adapter, adapter.decoder(model)
