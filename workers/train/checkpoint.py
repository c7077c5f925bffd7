"""Training checkpoints: speculators' format for the draft, safetensors and JSON for the rest.

A checkpoint is one directory under <out>/train/checkpoints/:
- config.json, model.safetensors   the draft, as speculators' save_pretrained writes it
                                   (speculators_model_type "eagle3"); vLLM loads the directory as is;
- training/optimizer.safetensors   the optimizer's tensors, one entry per "state/<param>/<key>";
- training/trainer_state.json      where training stands (epoch, step, scheduler, validation
                                   history, the optimizer's param groups), written last.
The training state sits in a subdirectory because vLLM loads every *.safetensors file at the
top of a model directory as weights. No pickle anywhere: no torch.save, no torch.load.

Atomic: everything is written into `.tmp-<name>-<pid>` beside the final name, fsynced, and
renamed into place, so a directory under its final name is complete, and a kill mid-save
leaves only a temp directory (safetensors' own temp file inside it), which `clean()` removes
and `latest()` never considers.
`best` is a relative symlink to one of them, replaced atomically (os.replace).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.workers.runtime import atomic

TRAINING = "training"
STATE = f"{TRAINING}/trainer_state.json"
MODEL = "model.safetensors"
CONFIG = "config.json"
OPTIMIZER = f"{TRAINING}/optimizer.safetensors"
BEST = "best"
FORMAT = "eyas-train-state"
FORMAT_VERSION = 1
_NAME = re.compile(r"(epoch|step)-(\d+)")
_PARTIAL = (".tmp-", ".old-", ".best-")


class CheckpointError(ValueError):
    """A checkpoint cannot be used for this run."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    state: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def global_step(self) -> int:
        return int(self.state["global_step"])


def clean(root: Path) -> int:
    """Remove what an interrupted save left (temp dirs, half-swapped dirs, temp links, and
    safetensors' own temp files). Only the main rank saves and cleans, before the others look,
    so nothing here can be a live write."""
    removed = 0
    if not root.is_dir():
        return 0
    for entry in root.iterdir():
        # Inside a temp dir safetensors' files go with it; one at the top level would be a
        # library writing straight into checkpoints/.
        if entry.name.startswith(_PARTIAL) or (atomic.is_library_temp(entry.name) and not entry.is_dir()):
            if entry.is_symlink() or entry.is_file():
                entry.unlink(missing_ok=True)
            else:
                shutil.rmtree(entry, ignore_errors=True)
            removed += 1
    return removed


def _complete(path: Path) -> dict[str, Any] | None:
    """The trainer state of a complete checkpoint directory, else None."""
    if path.is_symlink() or not path.is_dir() or not _NAME.fullmatch(path.name):
        return None
    if not all((path / f).is_file() for f in (CONFIG, MODEL, OPTIMIZER, STATE)):
        return None
    try:
        state = json.loads((path / STATE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and state.get("format") == FORMAT else None


def all_checkpoints(root: Path) -> list[Checkpoint]:
    """The complete checkpoints, oldest (lowest global step) first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        state = _complete(entry)
        if state is not None:
            found.append(Checkpoint(entry, state))
    return sorted(found, key=lambda c: (c.global_step, c.name.startswith("epoch")))


def latest(root: Path) -> Checkpoint | None:
    """The checkpoint a retry resumes from: the furthest complete one."""
    found = all_checkpoints(root)
    return found[-1] if found else None


def flatten_optimizer(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors for safetensors, the JSON rest) of an optimizer state dict keyed by parameter
    names (torch.distributed.checkpoint's get_optimizer_state_dict)."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for param, values in state_dict.get("state", {}).items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state/{param}/{key}"] = value.detach().to("cpu").contiguous()
            else:
                plain.setdefault(param, {})[key] = value
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state_dict.get("param_groups", [])
    ]
    return tensors, {"param_groups": groups, "plain_state": plain}


def unflatten_optimizer(tensors: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for name, value in tensors.items():
        _, param, key = name.split("/", 2) if name.count("/") >= 2 else ("", "", "")
        if not param:
            raise CheckpointError(f"optimizer tensor {name!r} is not named state/<param>/<key>")
        state.setdefault(param, {})[key] = value
    for param, values in (rest.get("plain_state") or {}).items():
        state.setdefault(param, {}).update(values)
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in rest.get("param_groups", [])]
    return {"state": state, "param_groups": groups}


def _fsync_tree(path: Path) -> None:
    # save_pretrained and safetensors do not fsync; the rename must not outrun the data.
    for root, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        atomic._fsync_dir(Path(root))  # noqa: SLF001 - the same helper the file writes use


def save(root: Path, name: str, model, model_state: dict, optim_state: dict, trainer_state: dict[str, Any]) -> Path:
    """Write checkpoint `name` (e.g. "epoch-2") under `root` atomically; returns its path.

    `model` is the bare speculators model (for save_pretrained's config and key filter);
    `model_state` / `optim_state` are full state dicts already gathered on this rank.
    """
    from safetensors.torch import save_file

    if not _NAME.fullmatch(name):
        raise ValueError(f"checkpoint name {name!r}: use epoch-<n> or step-<n>")
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, state_dict=model_state, safe_serialization=True)
        tensors, rest = flatten_optimizer(optim_state)
        (tmp / TRAINING).mkdir()
        save_file(tensors, tmp / OPTIMIZER)
        # Written last: a directory without it is never taken for a checkpoint, even if a
        # crash were to land it under its final name.
        atomic.write_json(
            tmp / STATE, {"format": FORMAT, "version": FORMAT_VERSION, **trainer_state, "optimizer": rest}
        )
        _fsync_tree(tmp)
        if final.exists():
            # Rename cannot replace a non-empty directory: swap it out first.
            old = root / f".old-{name}-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        atomic._fsync_dir(root)  # noqa: SLF001
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def set_best(root: Path, name: str) -> Path:
    """Point `best` at checkpoint `name` (a relative link, replaced atomically)."""
    link = root / BEST
    tmp = root / f".best-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(name, tmp)
    os.replace(tmp, link)
    atomic._fsync_dir(root)  # noqa: SLF001
    return link


def best(root: Path) -> Checkpoint | None:
    link = root / BEST
    if not link.is_symlink():
        return None
    target = root / os.readlink(link)
    state = _complete(target)
    return Checkpoint(target, state) if state is not None else None


def load_model_state(ckpt: Checkpoint) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(ckpt.path / MODEL)


def load_optimizer_state(ckpt: Checkpoint) -> dict[str, Any]:
    from safetensors.torch import load_file

    return unflatten_optimizer(load_file(ckpt.path / OPTIMIZER), ckpt.state.get("optimizer") or {})


def prune_steps(root: Path, keep: str) -> list[str]:
    """Delete every mid-epoch (step-<n>) checkpoint but `keep`: epoch checkpoints stay, and a
    step checkpoint is worth keeping only until a newer checkpoint exists."""
    doomed = [c for c in all_checkpoints(root) if c.name.startswith("step-") and c.name != keep]
    for c in doomed:
        # Out of sight first (a rename is atomic), then deleted: never a half-deleted checkpoint.
        hidden = root / f".old-{c.name}-{os.getpid()}"
        os.rename(c.path, hidden)
        shutil.rmtree(hidden, ignore_errors=True)
    return [c.name for c in doomed]
