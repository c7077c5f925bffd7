"""Load a target with transformers and find its decoder through the adapters.

The architecture is read from config.json and checked against the adapters before any
weight is loaded, so an unsupported target fails in milliseconds, not after minutes of loading.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from eyas.state.target import read_model_config
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
        return self._first(
            f"{path}: no transformers auto class loads", lambda auto: auto.from_pretrained(path, **kwargs)
        )

    def random(self, config, **kwargs):
        """The same auto classes, built from `config` with random weights."""
        return self._first("no transformers auto class builds", lambda auto: auto.from_config(config, **kwargs))

    def _first(self, failure: str, build):
        import transformers

        errors = []
        for auto in (
            transformers.AutoModelForCausalLM,
            transformers.AutoModelForImageTextToText,
            transformers.AutoModel,
        ):
            try:
                return build(auto)
            except ValueError as exc:  # "Unrecognized configuration class ... for this kind of AutoModel"
                errors.append(f"{auto.__name__}: {exc}")
        raise ValueError(f"{failure} {self.arch} ({'; '.join(errors)})")


def _random(cls, path: str, kwargs: dict[str, Any]):
    """The model of `path` with random weights: its config.json read as from_pretrained reads
    it, no weight file opened (the canary's dummy weights, canary/run.py)."""
    import transformers

    trust = bool(kwargs.get("trust_remote_code"))
    config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust)
    if isinstance(cls, _RemoteCode):
        model = cls.random(config, dtype=kwargs["dtype"], trust_remote_code=trust)
    else:
        model = cls._from_config(config, dtype=kwargs["dtype"])
    return model.to(kwargs["device_map"]) if "device_map" in kwargs else model


def load(
    path: str, dtype: str, trust_remote_code: bool = False, device: str = "cpu", random_weights: bool = False
) -> Target:
    """Load the target for inference: weights in `dtype` on `device`, eval mode (random weights
    of the same shapes with `random_weights`, for the canary)."""
    import torch

    arch, adapter, model_cfg = check(path)
    cls = _model_class(arch, trust_remote_code, path)
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    if device != "cpu":
        kwargs["device_map"] = device
    model = _random(cls, path, kwargs) if random_weights else cls.from_pretrained(path, **kwargs)
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
