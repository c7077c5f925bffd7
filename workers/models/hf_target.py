"""Load a target with transformers and find its decoder through the adapters.

The architecture is read from config.json and checked against the adapters before any
weight is loaded, so an unsupported target fails in milliseconds, not after minutes of loading.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from eyas.state.runconfig import read_model_config
from eyas.workers.models import adapters

log = logging.getLogger("eyas.hf_target")


@dataclass
class Target:
    model: Any
    architecture: str
    adapter: adapters.Adapter
    decoder: adapters.Decoder
    model_type: str | None


def check(path: str) -> tuple[str, adapters.Adapter, dict]:
    """(architecture, adapter, config.json) of the target at `path`; UnknownArchitecture if none fits."""
    model_cfg = read_model_config(path)
    arch = adapters.architecture_of(model_cfg)
    return arch, adapters.adapter_for(arch), model_cfg


def _model_class(arch: str, trust_remote_code: bool, path: str):
    """transformers' own class of that name, else (trust_remote_code) the model's own code."""
    import transformers

    cls = getattr(transformers, arch, None)
    if cls is not None:
        return cls
    if not trust_remote_code:
        raise ValueError(
            f"{path}: architecture {arch} is not built into transformers "
            f"{transformers.__version__}; set target.trust_remote_code = true to run the "
            "model's own code"
        )
    return _RemoteCode(arch)


class _RemoteCode:
    """The model's own code, through whichever auto class its config.json's auto_map names
    (that depends on the model: causal LM, image-text-to-text, or the bare AutoModel)."""

    def __init__(self, arch: str):
        self.arch = arch

    def from_pretrained(self, path, **kwargs):
        import transformers

        errors = []
        for auto in (
            transformers.AutoModelForCausalLM,
            transformers.AutoModelForImageTextToText,
            transformers.AutoModel,
        ):
            try:
                return auto.from_pretrained(path, **kwargs)
            except ValueError as exc:  # "Unrecognized configuration class ... for this kind of AutoModel"
                errors.append(f"{auto.__name__}: {exc}")
        raise ValueError(f"{path}: no transformers auto class loads {self.arch} ({'; '.join(errors)})")


def load(path: str, dtype: str, trust_remote_code: bool = False, device: str = "cpu") -> Target:
    """Load the target for inference: weights in `dtype` on `device`, eval mode."""
    import torch

    arch, adapter, model_cfg = check(path)
    cls = _model_class(arch, trust_remote_code, path)
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    if device != "cpu":
        kwargs["device_map"] = device
    model = cls.from_pretrained(path, **kwargs)
    model.eval()
    decoder = adapter.decoder(model)
    log.info(
        "loaded %s (%s adapter, decoder at %s, %d layers) in %s on %s",
        arch,
        adapter.family,
        decoder.path or "<top>",
        decoder.num_layers,
        dtype,
        device,
    )
    return Target(model, arch, adapter, decoder, model_cfg.get("model_type"))
