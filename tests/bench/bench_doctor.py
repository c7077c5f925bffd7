"""`eyas doctor` on a Kimi-K2.5-shaped target: whole process, imports included, <= 15 s, and
its time as a multiple of a bare `python -c "import vllm"` measured in the same run.

The target is config-only (config.json, a safetensors index naming 64 empty shards, a small
tokenizer; tests/support/doctor_models.py builds it), the run the Kimi example's (vLLM, TP 8), and the
GPUs eight fake H200s through $EYAS_FAKE_NVML, so every check runs and passes. Each doctor run
is a fresh `eyas doctor run.toml` process, each import a fresh interpreter; they alternate, so
load from others on a shared machine falls on both alike, and the medians of --runs each are
compared: doctor ÷ import vllm. Most of the doctor's time is the adapter check's import of
vLLM's model module for the architecture (its classes are read to check the adapter), which
imports vLLM, torch and transformers; every run is printed.

For scale, the same process cost of loading a tiny model of the same shape in vLLM (the
tiny DeepseekV3 of eyas.workers.models.assets: the DeepseekV2Model / DeepseekV2DecoderLayer classes
that Kimi-K2.5's language model maps to in vLLM) with the CPU build: `LLM(...)` engine up,
then exit. That is the least a run pays to find the same mistakes without the doctor.

Run: python tests/bench/bench_doctor.py [--runs 5] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUDGET_S = 15.0
HERE = Path(__file__).resolve().parent
EYAS = str(Path(sys.executable).parent / "eyas")
CACHE = Path(tempfile.gettempdir()) / "eyas-bench-doctor-v2"  # v2: the fakes carry the MoE/MLA shape keys

LOAD = """
import sys, time
t0 = time.monotonic()
from vllm import LLM
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=512, skip_tokenizer_init=True,
          enable_prefix_caching=False, compilation_config={"custom_ops": ["-rotary_embedding"]}, seed=0,
          attention_backend="CPU_MLA")  # as eyas's engine_args: AMX's MLA kernel packs no float32
print("ENGINE_UP", round(time.monotonic() - t0, 2), flush=True)
"""


def kimi_run(root: Path) -> Path:
    sys.path.insert(0, str(HERE.parent / "support"))
    from doctor_models import make_model, write_run

    from eyas.workers.models.assets import build_tokenizer

    if (root / "run.toml").exists():
        return root / "run.toml"
    root.mkdir(parents=True, exist_ok=True)
    tok = root / "tokenizer"
    build_tokenizer(tok)
    target = make_model(root, "kimi", tok)
    nvml = root / "nvml.json"
    nvml.write_text(
        json.dumps(
            {
                "devices": [
                    {"name": "NVIDIA H200", "uuid": f"GPU-{i}", "mem_total": 150 * 10**9, "mem_used": 10**9}
                    for i in range(8)
                ]
            }
        )
    )
    return write_run(root, target)


def timed(argv: list[str], env: dict, cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.monotonic()
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    return time.monotonic() - t0, proc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM load comparison")
    args = parser.parse_args()
    run = kimi_run(CACHE / "kimi")
    env = {**os.environ, "EYAS_FAKE_NVML": str(run.parent / "nvml.json")}
    # The doctor quiets vLLM's logging the same way (doctor/main.py, _quiet).
    bare = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    times, imports = [], []
    for i in range(args.runs):
        seconds, proc = timed([EYAS, "doctor", run.name, "--json"], env, run.parent)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
            print(f"eyas doctor exited {proc.returncode}: every check must pass on this target")
            return 1
        report = json.loads(proc.stdout)
        times.append(seconds)
        imported, proc = timed([sys.executable, "-c", "import vllm"], bare, run.parent)
        if proc.returncode != 0:
            print(proc.stderr[-3000:])
            print(f"`import vllm` exited {proc.returncode}")
            return 1
        imports.append(imported)
        print(
            f"run {i + 1}: eyas doctor (Kimi-shaped, {len(report['checks'])} checks, all {report['verdict']}) "
            f"{seconds:.2f} s (in-process {report['seconds']:.2f} s); python -c 'import vllm' {imported:.2f} s"
        )
    doctor_s, import_s = statistics.median(times), statistics.median(imports)
    print(
        f"median of {len(times)}: eyas doctor {doctor_s:.2f} s, import vllm {import_s:.2f} s; "
        f"ratio doctor/import-vllm {doctor_s / import_s:.2f} (budget {BUDGET_S:.0f} s)"
    )
    if not args.no_vllm:
        from eyas.workers.models import assets

        tiny = CACHE / "tiny-deepseek"
        if not (tiny / "model.safetensors").exists():
            assets.build_model(tiny, "deepseek_v3")
        venv = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
        seconds, proc = timed([sys.executable, "-c", LOAD, str(tiny)], venv, CACHE)
        if proc.returncode != 0:
            print(proc.stderr[-3000:])
            print(f"the vLLM load exited {proc.returncode}")
            return 1
        up = next((line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ENGINE_UP")), "?")
        print(
            f"vLLM loads the tiny same-shaped model (DeepseekV2Model, CPU build): {seconds:.2f} s whole process "
            f"({up} s to engine up)"
        )
        print(f"ratio: the vLLM load takes {seconds / doctor_s:.1f}x the doctor's time")
    if doctor_s > BUDGET_S:
        print(f"FAIL: eyas doctor took {doctor_s:.2f} s (median), over the {BUDGET_S:.0f} s budget")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
