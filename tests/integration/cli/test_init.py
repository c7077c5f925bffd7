"""`eyas init`: the real command on the demo's tiny DeepSeek-V3, a Kimi-K2.5-shaped and a
Llama-shaped checkpoint (config.json and a safetensors index, tests/support/doctor_models.py),
GPUs from a fake NVML file or --gpus/--gpu-memory; each file it writes passes the real
`eyas validate`, and `eyas doctor` on one prints the checks its header lists."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from doctor_models import EYAS, H200, make_model, tokenizer_files  # noqa: F401 (tokenizer_files: fixture)

from eyas.cli import init, initplan
from eyas.state import trainsteps
from eyas.state.drafttables import ExtractConfig
from eyas.state.inputtables import DataConfig, TargetConfig
from eyas.state.runconfig import RunConfig
from eyas.workers.doctor.check import Check
from eyas.workers.doctor.memory import memory as check_memory
from eyas.workers.models import assets

GB = 10**9
H100 = 85_520_809_984  # what NVML reports for an "80 GB" H100 (81559 MiB)


def _env(tmp_path: Path, nvml: dict | None) -> dict[str, str]:
    """The command's environment: a private state folder and a fake NVML (None: no driver)."""
    fake = tmp_path / "nvml.json"
    fake.write_text(json.dumps(nvml if nvml is not None else {"error": "LibraryNotFound"}))
    return {**os.environ, "EYAS_HOME": str(tmp_path / "home"), "EYAS_FAKE_NVML": str(fake)}


def _gpus(n: int, total: int) -> dict:
    return {"devices": [{"name": "NVIDIA H100 80GB HBM3", "mem_total": total, "mem_used": 0}] * n}


def eyas(*argv: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([EYAS, *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def init_and_validate(tmp_path: Path, target: Path, *flags: str, nvml: dict | None = None) -> dict:
    """`eyas init` into tmp_path/run.toml, then the real `eyas validate` on it; the file as TOML."""
    env = _env(tmp_path, nvml)
    made = eyas(
        "init", str(target), "--data", str(tmp_path / "chat.jsonl"), "-o", "run.toml", *flags, env=env, cwd=tmp_path
    )
    assert made.returncode == 0, made.stderr
    checked = eyas("validate", "run.toml", env=env, cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith("run.toml: valid")
    return tomllib.loads((tmp_path / "run.toml").read_text())


def model_facts(target: Path) -> tuple[int, int, int | None]:
    """(num_hidden_layers, vocab_size, weight bytes) as the checkpoint's own files give them."""
    cfg = json.loads((target / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    index = target / "model.safetensors.index.json"
    weights = json.loads(index.read_text())["metadata"]["total_size"] if index.exists() else None
    return text["num_hidden_layers"], text["vocab_size"], weights


def eagle3_ids(n: int) -> list[int]:
    """EAGLE-3's low, middle and high layers and the final output, for a target deep enough that
    none of them collide."""
    return [2, n // 2, n - 3, n]


def _devices(n: int, total: int, name: str = "NVIDIA H100 80GB HBM3") -> list[dict]:
    return [{"index": i, "name": name, "mem_total": total, "mem_used": 0} for i in range(n)]


def doctor_memory(target: Path, tp: int, gpus: int, memory: int, name: str = "") -> Check:
    """`eyas doctor`'s memory check of the extraction init would write at `tp` (hf at TP 1,
    vLLM above) on `gpus` idle GPUs of `memory` bytes."""
    config = json.loads((target / "config.json").read_text())
    _, _, weights = model_facts(target)
    run = RunConfig(
        name="t",
        target=TargetConfig(path=str(target)),
        data=DataConfig(path="/data.jsonl"),
        extract=ExtractConfig(backend="hf" if tp == 1 else "vllm", tensor_parallel_size=tp),
    )
    return check_memory(run, weights, _devices(gpus, memory, name), model=config)


def doctor_tp(target: Path, gpus: int, memory: int, name: str = "") -> int | None:
    """The definition init implements: the smallest power of two up to `gpus` (dividing the
    attention heads) whose extraction passes the doctor's memory check on idle GPUs."""
    cfg = json.loads((target / "config.json").read_text())
    heads = cfg.get("text_config", cfg).get("num_attention_heads")
    t = 1
    while t <= gpus:
        if heads % t == 0 and doctor_memory(target, t, gpus, memory, name).verdict == "pass":
            return t
        t *= 2
    return None


def doctor_on(tmp_path: Path, monkeypatch, nvml: dict) -> dict[str, Check]:
    """The real `eyas doctor` checks of tmp_path/run.toml, by label, with GPUs from `nvml`."""
    from eyas.workers.doctor import main as doctor

    fake = tmp_path / "doctor-nvml.json"
    fake.write_text(json.dumps(nvml))
    monkeypatch.setenv("EYAS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EYAS_FAKE_NVML", str(fake))
    return {c.label: c for c in doctor.diagnose(str(tmp_path / "run.toml"))}


def extract_reason(text: str) -> str:
    """The comment init writes above [extract]'s keys, its lines joined again."""
    block = text.split("\n[extract]\n", 1)[1].split("\nbackend = ", 1)[0]
    return " ".join(line.removeprefix("# ") for line in block.splitlines())


def write_chats(root: Path) -> Path:
    return assets.write_dataset(root / "chat.jsonl", n=60, malformed=False)


@pytest.fixture(scope="module")
def demo_target(tmp_path_factory) -> Path:
    """The demo's tiny DeepSeek-V3 (random weights, a model.safetensors of its own)."""
    return assets.build_model(tmp_path_factory.mktemp("demo") / "tiny-deepseek", "deepseek_v3")


def test_demo_target_without_gpus_is_a_cpu_run_on_the_hf_backend(tmp_path, demo_target):
    write_chats(tmp_path)
    run = init_and_validate(tmp_path, demo_target)
    n, vocab, _ = model_facts(demo_target)
    assert run["extract"]["layer_ids"] == eagle3_ids(n)
    assert (run["extract"]["backend"], run["extract"]["tensor_parallel_size"]) == ("hf", 1)
    assert run["resources"] == {"ranks": 1, "devices": "cpu"}
    assert run["draft"]["vocab_size"] == min(initplan.DRAFT_VOCAB, vocab)
    assert run["target"]["path"] == str(demo_target)
    assert run["data"]["path"] == str(tmp_path / "chat.jsonl")
    # The checkpoint's own dtype: the demo's target is saved in float32.
    assert run["target"]["dtype"] == json.loads((demo_target / "config.json").read_text())["dtype"]
    assert "stages" not in run  # one hf rank: nothing to override
    # The target answers the prompts again before anything reads the data (regenerate).
    assert run["pipeline"] == ["prepare", "regenerate", "extract", "vocab", "train", "evaluate"]
    regen_tokens = min(run["data"]["max_length"], 1024)  # never past max_length, nor the default
    assert run["regenerate"] == {"temperature": 0.0, "max_tokens": regen_tokens, "batch_size": 256}


@pytest.mark.parametrize(
    ("total_size", "flags", "nvml"),
    [
        # Kimi-K2.5 as published (595 GB): eight H100s as NVML reports them.
        (None, (), _gpus(8, H100)),
        # --gpus / --gpu-memory describe another host: 547 GB on 8 × 80 GB, 595 GB on 8 H200s.
        (547 * GB, ("--gpus", "8", "--gpu-memory", "80"), None),
        (None, ("--gpus", "8", "--gpu-memory", str(H200 / GB)), None),
    ],
    ids=["nvml-h100", "547GB-80GB", "h200"],
)
def test_kimi_shaped_target_on_eight_gpus_is_sharded_with_vllm_or_refused(
    tmp_path, monkeypatch, total_size, flags, nvml
):
    """The TP (or the refusal) is what the doctor's memory check says: a 547 GB or 595 GB target
    does not fit 8 × 80 GB within vLLM's budget, 595 GB fits 8 H200s at TP 8."""
    target = make_model(tmp_path, "kimi", _empty(tmp_path), total_size=total_size)
    write_chats(tmp_path)
    n, vocab, weights = model_facts(target)
    memory = H100 if nvml else int(float(flags[-1]) * GB)
    name = nvml["devices"][0]["name"] if nvml else ""
    tp = doctor_tp(target, 8, memory, name)
    if tp is None:
        at8 = doctor_memory(target, 8, 8, memory, name)
        env = _env(tmp_path, nvml)
        out = eyas("init", str(target), "--data", "chat.jsonl", *flags, "-o", "run.toml", env=env, cwd=tmp_path)
        assert out.returncode == 1, out.stderr
        assert f"does not fit 8 GPUs of {memory / GB:.2f} GB" in out.stderr and "no file written" in out.stderr
        # The doctor's own arithmetic at the largest TP, and its verdict.
        assert at8.detail.partition(", over what")[0] in out.stderr
        assert "over what vLLM may use" in out.stderr
        assert not (tmp_path / "run.toml").exists()
        return
    run = init_and_validate(tmp_path, target, *flags, nvml=nvml)
    assert tp > 1
    assert run["extract"] == {
        "backend": "vllm",
        "tensor_parallel_size": tp,
        "layer_ids": eagle3_ids(n),
        "batch_size": 8,
    }
    assert run["resources"] == {"ranks": 8, "devices": list(range(8))}
    assert run["stages"] == {"extract": {"ranks": 1}}  # the vllm backend is one driver rank
    assert run["draft"]["vocab_size"] == min(initplan.DRAFT_VOCAB, vocab)
    assert run["target"]["trust_remote_code"] is True  # its auto_map names its own code
    # `eyas doctor` on the file, on the GPUs it was written for: the memory check passes, and the
    # reason init wrote above tensor_parallel_size is that check's own arithmetic.
    memory_check = doctor_on(tmp_path, monkeypatch, {"devices": _devices(8, memory, name)})["resources: memory"]
    assert memory_check.verdict == "pass", memory_check.detail
    assert memory_check.data["tp"] == tp
    arithmetic = memory_check.detail.partition(";")[0]
    assert arithmetic.startswith(f"weights {math.ceil(weights / tp) / GB:.2f} GB/GPU ({weights / GB:.2f} GB ÷ TP {tp})")
    assert extract_reason((tmp_path / "run.toml").read_text()).startswith(
        f"tp {tp}: {arithmetic}, within what vLLM may use, "
    )


def test_kimi_shaped_target_that_fits_no_tp_is_refused_and_nothing_is_written(tmp_path):
    target = make_model(tmp_path, "kimi", _empty(tmp_path))
    write_chats(tmp_path)
    assert doctor_tp(target, 8, 80 * GB) is None
    assert doctor_memory(target, 8, 8, 80 * GB).verdict == "fail"
    env = _env(tmp_path, None)
    flags = ("--gpus", "8", "--gpu-memory", "80", "-o", "run.toml")
    out = eyas("init", str(target), "--data", "chat.jsonl", *flags, env=env, cwd=tmp_path)
    assert out.returncode == 1
    assert "does not fit 8 GPUs of 80.00 GB" in out.stderr and "no file written" in out.stderr
    assert not (tmp_path / "run.toml").exists()


@pytest.mark.parametrize(("gpus", "memory"), [(1, 24), (8, 80), (2, 16)])
def test_llama_shaped_target(tmp_path, monkeypatch, gpus, memory):
    target = make_model(tmp_path, "llama", _empty(tmp_path))
    write_chats(tmp_path)
    run = init_and_validate(tmp_path, target, "--gpus", str(gpus), "--gpu-memory", str(memory))
    n, vocab, weights = model_facts(target)
    tp = doctor_tp(target, gpus, memory * GB)
    assert run["extract"]["tensor_parallel_size"] == tp
    checks = doctor_on(tmp_path, monkeypatch, {"devices": _devices(gpus, memory * GB, "")})
    assert checks["resources: memory"].verdict == "pass", checks["resources: memory"].detail
    assert run["extract"]["backend"] == ("hf" if tp == 1 else "vllm")
    assert run["extract"]["layer_ids"] == eagle3_ids(n)
    assert run["resources"] == {"ranks": gpus, "devices": list(range(gpus))}
    assert run["draft"]["vocab_size"] == min(initplan.DRAFT_VOCAB, vocab)
    assert run["target"]["trust_remote_code"] is False
    # Training sized to the data (tests/integration/cli/test_init_sizing.py holds it to the real
    # plan): the steps the config states are state/trainsteps.py's count of its own keys, on the
    # rows estimated from the text (no tokenizer.json here: its bytes ÷ 4), and warm up for 5 %.
    from eyas.cli import datasize

    text = (tmp_path / "run.toml").read_text()
    stated = int(text.split("# passes over the data: ~", 1)[1].split(" steps", 1)[0])
    rows = datasize.estimate(DataConfig(path=str(tmp_path / "chat.jsonl")), str(target), 0)
    assert "4 bytes a token (the target has no tokenizer.json)" in rows.source
    train = run["train"]
    assert stated == trainsteps.total_steps(rows.train, train["batch_tokens"], gpus, train["epochs"])
    assert train["warmup_steps"] == round(0.05 * stated)
    assert (stated >= trainsteps.MIN_STEPS) != ("# WARNING: the data is too small for a useful draft" in text)


def test_a_second_init_onto_the_same_file_is_refused_and_leaves_it_unchanged(tmp_path, demo_target):
    write_chats(tmp_path)
    init_and_validate(tmp_path, demo_target)
    path = tmp_path / "run.toml"
    before, stat = path.read_bytes(), path.stat()
    again = eyas(
        "init", str(demo_target), "--data", "chat.jsonl", "--gpus", "0", "-o", "run.toml",
        env=_env(tmp_path, None), cwd=tmp_path,
    )  # fmt: skip
    assert again.returncode == 1
    assert again.stderr == (
        "eyas init: run.toml exists; not overwritten. Write elsewhere with -o NEW.toml, or remove run.toml first\n"
    )
    assert path.read_bytes() == before and path.stat().st_mtime_ns == stat.st_mtime_ns


def test_the_default_file_name_comes_from_the_target(tmp_path):
    target = make_model(tmp_path, "llama", _empty(tmp_path))
    write_chats(tmp_path)
    env = _env(tmp_path, None)
    made = eyas("init", str(target), "--data", "chat.jsonl", env=env, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert (tmp_path / f"{target.name}-eagle3.toml").is_file()
    assert tomllib.loads((tmp_path / f"{target.name}-eagle3.toml").read_text())["name"] == f"{target.name}-eagle3"


def test_data_is_required_and_must_exist(tmp_path):
    target = make_model(tmp_path, "llama", _empty(tmp_path))
    env = _env(tmp_path, None)
    missing = eyas("init", str(target), env=env, cwd=tmp_path)
    assert missing.returncode == 2 and "--data" in missing.stderr
    absent = eyas("init", str(target), "--data", "nope.jsonl", "-o", "run.toml", env=env, cwd=tmp_path)
    assert absent.returncode == 2
    assert f"run.toml: data.path: {tmp_path / 'nope.jsonl'} does not exist" in absent.stderr
    assert not (tmp_path / "run.toml").exists()


def test_gpus_without_their_memory_and_no_gpu_to_read_it_from(tmp_path):
    target = make_model(tmp_path, "llama", _empty(tmp_path))
    write_chats(tmp_path)
    out = eyas("init", str(target), "--data", "chat.jsonl", "--gpus", "2", env=_env(tmp_path, None), cwd=tmp_path)
    assert out.returncode == 2 and "add --gpu-memory GB" in out.stderr


def test_init_loads_no_engine(tmp_path):
    target = make_model(tmp_path, "llama", _empty(tmp_path))
    write_chats(tmp_path)
    code = (
        "import sys\n"
        "from eyas.cli.main import main\n"
        "rc = main(sys.argv[1:])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'vllm', 'safetensors', 'numpy') if m in sys.modules)\n"
        "print(f'rc={rc} heavy={heavy}')\n"
    )
    argv = ["init", str(target), "--data", "chat.jsonl", "--gpus", "2", "--gpu-memory", "16", "-o", "run.toml"]
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=_env(tmp_path, None), cwd=tmp_path
    )
    assert out.stdout.strip().splitlines()[-1] == "rc=0 heavy=[]", out.stderr


def test_the_checks_listed_at_the_top_are_the_ones_eyas_doctor_runs(tmp_path, monkeypatch, tokenizer_files):
    """init's header against the doctor itself, on a Kimi-shaped target on eight H200s."""
    from eyas.workers.doctor import main as doctor
    from eyas.workers.doctor.versions import PACKAGES

    target = make_model(tmp_path, "kimi", tokenizer_files)
    write_chats(tmp_path)
    init_and_validate(tmp_path, target, nvml=_gpus(8, H200))
    monkeypatch.setenv("EYAS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EYAS_FAKE_NVML", str(tmp_path / "nvml.json"))
    checks = doctor.diagnose(str(tmp_path / "run.toml"))
    assert [c for c in checks if c.verdict == "fail"] == []
    listed = [f"versions: {p}" for p in PACKAGES] + [
        group if names == (group,) else f"{group}: {name}" for group, names, _ in init.DOCTOR_CHECKS for name in names
    ]
    assert [c.label for c in checks] == listed
    header = (tmp_path / "run.toml").read_text().split("\nname = ")[0]
    for group, names, _ in init.DOCTOR_CHECKS:
        assert (f"#   {group} (" if names == (group,) else f"#   {group}: {', '.join(names)} (") in header


def _empty(root: Path) -> Path:
    """No tokenizer files: init reads none (the doctor's test above gets a real one)."""
    path = root / "no-tokenizer"
    path.mkdir(exist_ok=True)
    return path
