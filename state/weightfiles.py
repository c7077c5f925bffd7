"""What weight files a target directory holds, from its listing and its safetensors index alone: no weight file is opened.

eyas loads a target's weights only from safetensors. transformers' `from_pretrained` and vLLM's
default loader (`load_format = "auto"`) would fall back to pickled `*.bin` / `*.pt` files and
unpickle them (`torch.load`, weights_only); eyas never unpickles, so a directory holding only
those counts as holding no weights eyas will load (state/preload.py refuses it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Pickled PyTorch checkpoints: what the loaders fall back to when no *.safetensors is there.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


@dataclass(frozen=True)
class WeightFiles:
    """The weight files at the top of a target directory (where vLLM and transformers look)."""

    path: str
    safetensors: tuple[str, ...]  # every *.safetensors file, sorted
    pickles: tuple[str, ...]  # every *.bin / *.pt / *.pth file, sorted
    index_error: str | None  # why model.safetensors.index.json is unusable; None: absent or fine
    shards: tuple[str, ...]  # the files the index's weight_map names ((): no index)
    missing: tuple[str, ...]  # of those, the ones that are not there
    total_size: int | None  # the index's metadata.total_size, when it gives one

    @property
    def has_index(self) -> bool:
        return bool(self.shards) or self.index_error is not None

    @property
    def complete(self) -> bool:
        """Whether a safetensors loader finds every weight: an index whose shards are all there,
        or (no index) at least one *.safetensors file."""
        if self.has_index:
            return self.index_error is None and not self.missing
        return bool(self.safetensors)

    def size(self) -> int | None:
        """The weights' bytes: the index's total_size, else the *.safetensors files' sizes on disk."""
        if self.total_size is not None:
            return self.total_size
        total = 0
        for name in self.safetensors:
            try:
                total += (Path(self.path) / name).stat().st_size
            except OSError:
                continue
        return total or None


def _positive(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def scan(path: str | os.PathLike) -> WeightFiles:
    """List `path`'s weight files and read its safetensors index (OSError when `path` cannot be listed)."""
    root = Path(path)
    names = sorted(e.name for e in os.scandir(root) if e.is_file())
    safetensors = tuple(n for n in names if n.endswith(".safetensors"))
    pickles = tuple(n for n in names if n.endswith(PICKLE_SUFFIXES))
    error, shards, total = None, (), None
    if (root / INDEX).exists():
        try:
            data = json.loads((root / INDEX).read_text(encoding="utf-8"))
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"weight_map is {weight_map!r}, not a table of tensor names to files")
            if not all(isinstance(v, str) and v for v in weight_map.values()):
                raise ValueError("weight_map names a file that is not a string")
            shards = tuple(sorted(set(weight_map.values())))
            meta = data.get("metadata")
            total = _positive(meta.get("total_size")) if isinstance(meta, dict) else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            shards = ()
    missing = tuple(s for s in shards if not (root / s).is_file())
    return WeightFiles(str(root), safetensors, pickles, error, shards, missing, total)
