"""The temp files safetensors writes for itself (".tmpAbC123" beside the target, renamed over it
when done) are removed on resume, in hidden_states/ and in checkpoints/, and complete files are
left alone. Each leftover is a real one: safetensors' save_file killed mid-write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import torch
from extract_harness import run_stage, sha256s, token_rows, write_dataset

from eyas.workers.models import assets

# A child that saves a 4 MB tensor with a 64 kB file size limit: the kernel kills it with
from eyas.workers.runtime import atomic
from eyas.workers.train import checkpoint

# SIGXFSZ mid-write (Python ignores that signal by default, so it is reset first), and the
# temp file safetensors was writing stays behind, as after any kill.
_KILLED_MID_SAVE = """
import resource, signal, sys, torch
from safetensors.torch import save_file
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
save_file({"hidden_states": torch.zeros(1 << 20)}, sys.argv[1])
"""


def safetensors_leftover(directory: Path, target: str) -> Path:
    """Kill safetensors' save_file of `directory/target` mid-write; returns the file it left."""
    before = set(os.listdir(directory))
    p = subprocess.run([sys.executable, "-c", _KILLED_MID_SAVE, str(directory / target)], timeout=120)
    assert p.returncode == -signal.SIGXFSZ
    (name,) = set(os.listdir(directory)) - before
    assert atomic.is_library_temp(name), name
    assert not (directory / target).exists()
    return directory / name


def age(path: Path, before: float) -> None:
    """Date the file's last write before `before`, as a file an earlier attempt wrote is."""
    os.utime(path, (before - 5, before - 5))


def test_library_temp_names():
    assert atomic.is_library_temp(".tmpAbC123")
    for name in (
        ".hs_3.safetensors.41.0.tmp",
        ".tmp-epoch-1-41",
        ".tmpAbC12",
        ".tmpAbC1234",
        ".tmpAb-123",
        "tmpAbC1234",
        ".tmpAbC12é",
    ):
        assert not atomic.is_library_temp(name), name


def test_extract_resume_removes_safetensors_leftovers_and_keeps_complete_files(tmp_path):
    target = assets.build_model(tmp_path / "llama", "llama")
    lengths = [9, 14, 5, 11, 7, 3]
    write_dataset(tmp_path / "out", token_rows(target, lengths))
    run_stage(tmp_path / "out", target, batch_size=2)
    extract_dir = tmp_path / "out" / "extract"
    hs_dir = extract_dir / "hidden_states"
    before = sha256s(extract_dir)

    # A killed attempt: two files missing, safetensors' temp file for one of them left behind.
    for idx in (1, 4):
        (hs_dir / f"hs_{idx}.safetensors").unlink()
    stale = safetensors_leftover(hs_dir, ".hs_4.safetensors.999.0.tmp")
    # The in-process stage below starts "now" as this test process did: date the leftover
    # before that, as an earlier attempt's is before a new rank process starts.
    age(stale, psutil.Process().create_time())
    # A peer rank's write in flight (written after this rank started) must survive.
    live = safetensors_leftover(hs_dir, ".hs_2.safetensors.998.0.tmp")
    kept = {p.name: p.stat().st_ino for p in hs_dir.glob("hs_*.safetensors")}

    run_stage(tmp_path / "out", target, batch_size=2)
    assert not stale.exists() and live.exists()
    assert {n: (hs_dir / n).stat().st_ino for n in kept} == kept  # complete files untouched
    assert sha256s(extract_dir) == before
    live.unlink()
    assert sorted(p.name for p in hs_dir.iterdir()) == sorted(f"hs_{i}.safetensors" for i in range(len(lengths)))


class _Draft(torch.nn.Module):
    """save_pretrained as speculators' writes it: config.json and model.safetensors."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(2, 2)

    def save_pretrained(self, path, state_dict, safe_serialization):
        from safetensors.torch import save_file

        Path(path).mkdir(parents=True)
        (Path(path) / "config.json").write_text("{}")
        save_file({k: v.contiguous() for k, v in state_dict.items()}, Path(path) / "model.safetensors")


def test_checkpoint_clean_removes_safetensors_leftovers_and_keeps_complete_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    model = _Draft()
    done = checkpoint.save(
        root, "epoch-1", model, model.state_dict(), {"state": {}, "param_groups": []}, {"global_step": 4}
    )
    checkpoint.set_best(root, "epoch-1")
    files = {p: p.read_bytes() for p in done.rglob("*") if p.is_file()}
    # A save killed inside its temp dir (safetensors' file in it), and one at the top level.
    partial = root / ".tmp-epoch-2-999"
    partial.mkdir()
    safetensors_leftover(partial, "model.safetensors")
    top = safetensors_leftover(root, "model.safetensors")

    assert checkpoint.clean(root) == 2  # what train's resume runs on the main rank
    assert not partial.exists() and not top.exists()
    assert sorted(p.name for p in root.iterdir()) == ["best", "epoch-1"]
    assert {p: p.read_bytes() for p in done.rglob("*") if p.is_file()} == files
    assert checkpoint.latest(root).name == "epoch-1" and checkpoint.best(root).name == "epoch-1"
