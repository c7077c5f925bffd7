"""Run configs for the tests, written from dicts as TOML (tomli-w): one way to spell a run, instead of string templates in each test file."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import tomli_w


def _plain(value: Any) -> Any:
    """What TOML can hold: paths as strings, tuples as arrays, None left out (the default applies)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def run_toml(name: str, pipeline: list[str] | None = None, **keys: Any) -> str:
    """A run config: `name`, `pipeline` (None: eyas's default), and each keyword as a top-level
    key (output_dir = ..., preflight = false) or table (target = {...}, stages = {"train": {...}})."""
    return tomli_w.dumps(_plain({"name": name, "pipeline": pipeline, **keys}))


def toml_value(literal: str) -> Any:
    """A value written as TOML (`'"cpu"'`, `"[0, 1]"`) as Python."""
    return tomllib.loads(f"v = {literal}")["v"]


def extract_toml(
    name: str,
    output_dir: Path,
    target: Path,
    *,
    backend: str = "hf",
    ranks: int = 1,
    tp: int | None = None,
    batch_size: int = 4,
    layer_ids: list[int] | None = None,
    options: dict | None = None,
) -> str:
    """An extract-only run on CPU of a tiny float32 target. The preflight is off: these runs test
    extraction alone (the doctor's tests cover the preflight stage)."""
    return run_toml(
        name,
        ["extract"],
        output_dir=output_dir,
        preflight=False,
        target={"path": target, "dtype": "float32"},
        resources={"ranks": ranks, "devices": "cpu"},
        extract={"backend": backend, "tensor_parallel_size": tp, "batch_size": batch_size, "layer_ids": layer_ids},
        # The default 32000 exceeds the tiny vocabulary.
        draft={"vocab_size": 256},
        stages={"extract": {"options": options}} if options is not None else None,
    )
