"""`eyas init TARGET_DIR --data FILE [--gpus N] [--gpu-memory GB] [-o OUT.toml]`: write a commented run config for a target that `eyas validate` accepts, each choice explained beside its key, never over an existing file.

It reads what the doctor reads, with json and the stdlib (eyas.workers.doctor.target: config.json
and the safetensors index; devices.probe_gpus: NVML), and never an engine: the CLI loads no
torch. The decisions are cli/initplan.py's arithmetic, and [train]'s schedule is sized to the
data's rows (cli/datasize.py counts them, state/trainsteps.py sizes); the defaults it does not
decide are the run config's own (state/runconfig.py and its tables), read from its models rather than repeated here.

--data is required: prepare reads it and `eyas validate` checks that it exists, so a placeholder
would make a file that fails validation. The config is validated before it is written; a
rejected one is not written at all.

Exit status: 0 written (data too small for a useful draft is said on stderr and in the file);
1 refused (the file exists, the target fits no GPU count given); 2 bad input (no target, no data,
a config that would not validate).
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

from eyas.cli import initplan
from eyas.state import drafttables, inputtables, regenerate, runconfig, trainsteps
from eyas.state.specs import DEFAULT_PIPELINE
from eyas.state.target import default_layer_ids, text_value
from eyas.workers.doctor.check import human_bytes

COLUMN = 36  # inline comments start here, as in workers/examples/*.toml
WIDTH = 110  # of a line, comments included


class InitError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


# The checks `eyas doctor` runs on a config of the full pipeline, by the labels it prints
# ("group: name" of a passing run; workers/doctor/main.py: run_checks, in its order), with what
# each looks at. The versions' names are versions.PACKAGES; tests/integration/cli/test_init.py
# holds the rest to what the doctor prints for a file init wrote.
DOCTOR_CHECKS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("data", ("rows",), "each file prepare reads: encoding, binary, over-long rows, the first rows parse"),
    (
        "target",
        ("config.json", "weights", "tensor parallel", "trust_remote_code"),
        "shape, safetensors index and shards, TP against heads and experts, custom code",
    ),
    ("layer ids", ("layer ids",), "the ids against the target's depth"),
    (
        "resources",
        ("gpus", "memory", "disk", "output dir"),
        "weights ÷ TP + activations + KV cache + CUDA context per GPU, hidden states' disk",
    ),
    ("tokenizer", ("load", "assistant mask"), "the chat template's assistant-only mask on a two-turn probe"),
    ("adapter", ("architecture", "decoder", "embedding", "layer forward"), "the backend's classes, read from source"),
)


def _toml(value: Any) -> str:
    """A TOML literal for the values init writes (JSON's string escapes are TOML's too)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"no TOML literal for {value!r}")


def _comment(text: str) -> list[str]:
    # Not at hyphens: "--gpu-memory" must stay whole.
    return textwrap.wrap(text, WIDTH, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)


def _key(key: str, value: Any, why: str = "") -> list[str]:
    """`key = value`, its reason inline when it fits on the line, else on comment lines above."""
    line = f"{key} = {_toml(value)}"
    if not why:
        return [line]
    inline = f"{line.ljust(COLUMN)}# {why}"
    if len(line) < COLUMN and len(inline) <= WIDTH:
        return [inline]
    return [*_comment(why), line]


def run_name(target: Path) -> str:
    """The run's name: the target folder's and "-eagle3", in the letters a run name may hold."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", target.name).strip("-.") or "target"
    return f"{base[:73]}-eagle3"


def _read_target(path: Path):
    from eyas.workers.doctor import target

    if not path.is_dir():
        raise InitError(2, f"{path} is not a directory; give the target model's folder (the one with config.json)")
    facts, checks = target.read(str(path))
    if facts is None:
        bad = checks[0]
        raise InitError(2, f"{bad.detail}; {bad.fix}")
    if facts.num_layers is None:
        raise InitError(
            2,
            f"{path}/config.json has no num_hidden_layers (nor text_config.num_hidden_layers); eyas init needs the depth",
        )
    return facts, target.remote_code(facts, False)


def _gpus(args) -> tuple[int, int | None, str, str]:
    """(GPUs, bytes of memory per GPU or None, where those figures come from, the GPU's name or
    "" when NVML does not give it: vLLM's batch defaults, which the memory need grows with, read
    it; "" sizes for the larger of them)."""
    memory = int(args.gpu_memory * 1e9) if args.gpu_memory is not None else None
    if args.gpus == 0:
        return 0, None, "--gpus 0: CPU mode", ""
    if args.gpus is not None and memory is not None:
        return args.gpus, memory, f"--gpus {args.gpus} of --gpu-memory {human_bytes(memory)}", ""
    from eyas.workers.doctor.devices import probe_gpus

    found = probe_gpus()
    devices = found.devices if found.available else []
    count = args.gpus if args.gpus is not None else len(devices)
    if count == 0:
        if memory is not None:
            raise InitError(2, "--gpu-memory without GPUs: no GPU is visible here; add --gpus N for the run's host")
        # GpuProbe's reason ends in what it means for the daemon's metrics, which is not news here.
        why = (found.why or "NVML lists none").partition("): GPU metrics off")[0].removeprefix("no NVML (")
        return (
            0,
            None,
            f"no GPU visible ({why}): CPU mode; --gpus N --gpu-memory GB writes a config for a GPU host",
            "",
        )
    name = ""
    if memory is None:
        if not devices:
            raise InitError(
                2,
                f"--gpus {count}: no GPU is visible here to read its memory from ({found.why or 'NVML lists none'}); "
                "add --gpu-memory GB (each GPU's memory)",
            )
        # The smallest, since a shard must fit whichever GPU it lands on; the total, not the free
        # memory, since this sizes the run for the host (doctor checks the free memory before it).
        small = min(devices, key=lambda d: d["mem_total"])
        memory, name = small["mem_total"], small.get("name") or ""
        where = f"the smallest: GPU {small['index']}, {name}"
    else:
        where = "--gpu-memory"
    counted = "--gpus" if args.gpus is not None else "NVML"
    return (
        count,
        memory,
        f"{count} GPU{'s' if count != 1 else ''} ({counted}), {human_bytes(memory)} each ({where})",
        name,
    )


def _data_tokens(path: Path) -> int | None:
    """The data's tokens, estimated as the doctor estimates them (bytes ÷ BYTES_PER_TOKEN, which
    errs high), or None when the path holds no data file."""
    from eyas.workers.data.reader import DataError, data_files
    from eyas.workers.doctor.disk import BYTES_PER_TOKEN

    try:
        files = data_files(path)
    except DataError:
        return None
    return sum(f.stat().st_size for f in files) // BYTES_PER_TOKEN


def _train_keys(args, data_path: Path, facts, max_length: int, fraction: float, ranks: int, train):
    """[train]'s epochs, lr, batch_tokens and warmup_steps sized to the data (state/trainsteps.py),
    with their reasons; comment lines come as ("#", None, text). A warning for data too small
    for a useful draft goes to `args.warnings` too, for the terminal."""
    from eyas.cli import datasize

    data = inputtables.DataConfig(path=str(data_path), max_length=max_length, validation_fraction=fraction)
    found = datasize.estimate(data, str(Path(facts.path)), train.seed)
    if found is None or not found.train:
        why = "no data rows to count steps from: the run config's defaults"
        return [
            ("#", None, why),
            ("epochs", train.epochs, "passes over the data"),
            ("lr", train.lr, "AdamW, then decay"),
            ("batch_tokens", train.batch_tokens, "samples packed up to this many tokens per rank and step"),
            ("warmup_steps", train.warmup_steps, "no steps counted: no warmup"),
        ]
    sched = trainsteps.size(found.train, ranks, train.seed)
    out = [("#", None, initplan.sizing_comment(sched, len(found.train), found.source))]
    if sched.too_small:
        warning = initplan.too_small(sched, found.answer_tokens, ranks)
        if isinstance(getattr(args, "warnings", None), list):
            args.warnings.append(warning)
        out.append(("#", None, f"WARNING: {warning}."))
    return out + initplan.train_keys(sched)


def _dtype(cfg: dict) -> tuple[str, str]:
    written = text_value(cfg, "torch_dtype") or text_value(cfg, "dtype")
    if written in inputtables.DTYPES:
        return written, f"the checkpoint's own dtype (config.json: {written})"
    found = f"config.json names {written!r}" if written else "config.json names none"
    return "bfloat16", f"{found}; bfloat16, what current GPUs compute in"


def memory_judge(
    model: dict[str, Any] | None,
    weight_bytes: int,
    gpu_memory: int,
    gpu_name: str = "",
    *,
    target: str = "/target",
    data: str = "/data.jsonl",
    dtype: str = "bfloat16",
    max_length: int | None = None,
) -> initplan.Judge:
    """`eyas doctor`'s memory check as initplan's Judge: for a TP, the run config init would
    write with it (extract on the hf backend at TP 1, on vLLM above; no engine options), its
    Engine as the doctor derives it (memoryestimate.engine_of), the doctor's estimate of one idle GPU
    of `gpu_memory` bytes, and the doctor's room there: on vLLM the installed vLLM's default
    gpu_memory_utilization × the card (vLLM's budget), on hf the whole card (its free memory).
    `model`: the target's config.json, which sizes activations and the KV cache."""
    from eyas.workers.doctor import memoryestimate

    shape = memoryestimate.shape_of(model)
    gpu = {"index": 0, "name": gpu_name, "mem_total": gpu_memory, "mem_used": 0}
    util, util_from = memoryestimate.vllm_default_utilization()
    data_cfg = (
        inputtables.DataConfig(path=data)
        if max_length is None
        else inputtables.DataConfig(path=data, max_length=max_length)
    )

    def judge(tp: int) -> initplan.Fit:
        backend = "vllm" if tp > 1 else "hf"
        cfg = runconfig.RunConfig(
            name="init",
            target=inputtables.TargetConfig(path=target, dtype=dtype),
            data=data_cfg,
            extract=drafttables.ExtractConfig(backend=backend, tensor_parallel_size=tp),
        )
        engine = memoryestimate.engine_of(cfg)
        need = memoryestimate.estimate(engine, shape, weight_bytes, gpu)
        if backend == "vllm":  # memory.memory: need ≤ int(util × total) ≤ free
            room = int(util * gpu_memory)
            room_text = f"what vLLM may use, {util:.2f} × {human_bytes(gpu_memory)} = {human_bytes(room)} ({util_from})"
        else:  # need ≤ free, all of an idle card
            room = gpu_memory
            room_text = f"the {human_bytes(gpu_memory)} of one GPU (the hf backend may use all of it)"
        return initplan.Fit(need.total, room, memoryestimate.arithmetic(need, engine), room_text)

    return judge


def render(
    args, facts, remote, gpus: int, gpu_memory: int | None, gpu_source: str, out: Path, gpu_name: str = ""
) -> str:
    """The config's text. Raises initplan.NoFit when the target fits no TP the GPUs allow."""
    from eyas.workers.doctor.target import INDEX, SINGLE, explain_layer_ids
    from eyas.workers.doctor.versions import PACKAGES

    cfg, n = facts.config, facts.num_layers
    heads = text_value(cfg, "num_attention_heads")
    heads = heads if isinstance(heads, int) and heads > 0 else None
    ids = list(default_layer_ids(n))
    dtype, dtype_why = _dtype(cfg)
    width = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    data_path = Path(args.data).expanduser().absolute()
    defaults_data = inputtables.DataConfig.model_fields
    train, evaluate, draft = drafttables.TrainConfig(), drafttables.EvaluateConfig(), drafttables.DraftConfig()
    max_length = defaults_data["max_length"].default
    positions = text_value(cfg, "max_position_embeddings")
    length_why = "tokens per sample after truncation (hidden-state disk grows with it)"
    if isinstance(positions, int) and 16 <= positions < max_length:
        max_length, length_why = positions, f"the target's max_position_embeddings; {length_why}"
    judge = None
    if gpus and gpu_memory is not None and facts.weight_bytes is not None:
        judge = memory_judge(
            cfg,
            facts.weight_bytes,
            gpu_memory,
            gpu_name,
            target=str(Path(facts.path).absolute()),
            data=str(data_path),
            dtype=dtype,
            max_length=max_length,
        )
    plan = initplan.place(gpus, judge, gpu_memory, heads)
    fraction = defaults_data["validation_fraction"].default
    ranks = max(plan.gpus, 1)
    tokens = _data_tokens(data_path)
    per_token = len(ids) * (facts.hidden_size or 0) * width + 8  # + the int64 token id, as the doctor counts

    weights = (
        f"{human_bytes(facts.weight_bytes)} of weights ({INDEX if (Path(facts.path) / INDEX).exists() else SINGLE})"
        if facts.weight_bytes
        else "weights' size unknown (no safetensors index)"
    )
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
    shape = f"{facts.architecture or '?'} ({cfg.get('model_type') or 'no model_type'}" + (
        f", text model {text_cfg.get('model_type')})" if text_cfg and text_cfg.get("model_type") else ")"
    )
    lines = [
        f"# An EAGLE-3 draft for {Path(facts.path).name}, written by `eyas init`; every choice is explained beside its key.",
        *_comment(
            f"Target: {shape}: {n} layers, hidden {facts.hidden_size or '?'}, vocabulary {facts.vocab_size or '?'}, "
            f"{weights}."
        ),
        *_comment(f"GPUs: {gpu_source}."),
        "#",
        f"# Check it:  eyas validate {out.name}",
        f"#            eyas doctor {out.name}      (--canary also runs the extraction's canary now)",
        f"# Run it:    eyas submit {out.name} --follow",
        "#",
        "# eyas doctor checks, in this order (the preflight stage runs them before any other stage):",
        f"#   versions: {', '.join(PACKAGES)} (installed, against the supported matrix)",
    ]
    for group, names, what in DOCTOR_CHECKS:
        listed = group if names == (group,) else f"{group}: {', '.join(names)}"
        lines.append(f"#   {listed} ({what})")
    canary = (
        f"then the canary (extract.canary): the {plan.backend} backend at tensor parallel {plan.tp} on a "
        "shrunken, dummy-weight copy of the target, over two batches of this data; its captures are checked"
    )
    lines += textwrap.wrap(canary, WIDTH, initial_indent="#   ", subsequent_indent="#     ")
    lines += ["", *_key("name", run_name(Path(facts.path)))]
    disk = (
        f"The hidden states take {len(ids)} ids × {facts.hidden_size} × {width} B + 8 B = {human_bytes(per_token)} a "
        f"token" + (f": ~{human_bytes(per_token * tokens)} for this data (~{tokens} tokens)" if tokens else "")
        if facts.hidden_size
        else "The hidden states take layer ids × hidden_size × dtype bytes a token"
    )
    lines += _comment(
        f"output_dir is left out: the daemon writes under <state>/runs/<id>/out. {disk}; "
        "set output_dir to a folder on a disk with that room."
    )
    # regenerate right after prepare: the draft learns from the answers the target itself gives
    # (state/regenerate.py), which is what it will be asked to predict when it serves.
    pipeline = list(DEFAULT_PIPELINE)
    pipeline.insert(pipeline.index("prepare") + 1, "regenerate")
    lines += _comment(
        "preflight (the checks above) runs first; preflight = false drops it. regenerate has the target "
        "answer the data's prompts again, so the draft learns the target's own answers; drop it to train "
        "on the data's answers as they are."
    )
    lines += _key("pipeline", pipeline)

    lines += ["", "[target]", *_key("path", str(Path(facts.path).absolute())), *_key("dtype", dtype, dtype_why)]
    if remote.data.get("auto_map"):
        files = ", ".join(remote.data.get("files", []))
        why = f"config.json's auto_map names custom code ({files}): read it first, it runs in every rank"
        lines += _key("trust_remote_code", True, why)
    else:
        lines += _key("trust_remote_code", False, "no auto_map: transformers' and vLLM's own classes")

    lines += ["", "[data]", *_key("path", str(data_path), "--data")]
    lines += _key("format", "auto", "sharegpt, openai messages or tokenized rows, per file")
    lines += _key("max_length", max_length, length_why)
    lines += _key("validation_fraction", fraction, "held out: validation loss each epoch, evaluate's prompts")

    lines += ["", "[regenerate]"]
    lines += _comment(
        "The target writes every assistant turn again in vLLM, turn by turn, each on its own earlier "
        "answers, greedy by default; finished batches survive a kill (eyas retry resumes them)."
    )
    lines += _key("temperature", regenerate.RegenerateConfig().temperature, "0: greedy, as evaluate measures")
    regen_tokens = min(max_length, regenerate.RegenerateConfig().max_tokens)
    lines += _key("max_tokens", regen_tokens, "per answer, at most; never past data.max_length")
    lines += _key("batch_size", regenerate.RegenerateConfig().batch_size, "rows generated, and resumed, together")

    lines += ["", "[extract]", *_comment(f"{plan.why}.")]
    lines += _key("backend", plan.backend, "vLLM, sharded" if plan.backend == "vllm" else "transformers")
    lines += _key("tensor_parallel_size", plan.tp, "vLLM's shards" if plan.tp > 1 else "one whole model per rank")
    lines += _comment(
        f"EAGLE-3's low, middle and high layers [2, N//2, N-3] and the final output N, for N = {n}: "
        f"{explain_layer_ids(ids, n)}."
    )
    lines += _key("layer_ids", ids)
    lines += _key("batch_size", drafttables.ExtractConfig().batch_size, "samples per forward")

    lines += ["", "[resources]"]
    if plan.gpus:
        lines += _key("ranks", plan.gpus, "one training rank per GPU (DDP)")
        lines += _key("devices", list(range(plan.gpus)), f"the {plan.gpus} GPUs counted above")
    else:
        lines += _key("ranks", 1, "one rank: on CPU each rank holds a whole copy of the target")
        lines += _key("devices", "cpu", "no GPU: see the GPUs line at the top")

    vocab = initplan.draft_vocab(facts.vocab_size)
    vocab_why = (
        f"the target's whole vocabulary: it has only {facts.vocab_size} tokens"
        if facts.vocab_size is not None and vocab == facts.vocab_size
        else f"the {vocab} most frequent of the target's {facts.vocab_size or '?'} tokens (vocab stage)"
    )
    lines += ["", "[draft]", *_key("vocab_size", vocab, vocab_why)]
    lines += _key("num_layers", draft.num_layers, "one decoder layer, EAGLE-3's usual head")
    lines += _key("ttt_steps", draft.ttt_steps, "train this many steps ahead (test-time training)")

    lines += ["", "[train]"]
    for key, value, why in _train_keys(args, data_path, facts, max_length, fraction, ranks, train):
        lines += _comment(why) if key == "#" else _key(key, value, why)
    lines += _key("grad_clip", train.grad_clip, "the gradient norm's bound")
    lines += _key("seed", train.seed, "data order, validation split and initial weights")
    lines += _key("strategy", train.strategy, "DDP: a 1-layer draft fits each rank whole")

    lines += ["", "[evaluate]"]
    lines += _comment(
        "The trained draft as the target's EAGLE-3 speculator in vLLM, beside the untrained one and the "
        f"target alone; greedy outputs must match. tensor_parallel_size is left out: extract's ({plan.tp})."
    )
    lines += _key("num_speculative_tokens", evaluate.num_speculative_tokens, "k: draft tokens per target forward")
    lines += _key("max_tokens", evaluate.max_tokens, "greedy tokens per prompt")
    lines += _key("max_prompts", evaluate.max_prompts, "of the validation rows")
    lines += _key("batch_size", evaluate.batch_size, "sequences vLLM runs at once")
    if plan.backend == "vllm" and plan.gpus > 1:
        lines += ["", "[stages.extract]"]
        lines += _key("ranks", 1, f"the vllm backend is one driver rank; vLLM starts the {plan.tp} TP workers")
    return "\n".join(lines) + "\n"


def _check(text: str, out: Path) -> None:
    """The file as `eyas validate` would read it from `out`."""
    try:
        runconfig.validate(tomllib.loads(text), out.absolute().parent, str(out))
    except runconfig.ConfigError as exc:
        raise InitError(2, f"{out} not written: it would not pass eyas validate:\n" + "\n".join(exc.errors)) from None


def _write(text: str, out: Path) -> None:
    """Create `out` with `text`; never over an existing file (O_EXCL, so not even in a race)."""
    try:
        f = open(out, "x", encoding="utf-8")
    except FileExistsError:
        raise _exists(out) from None
    except OSError as exc:
        raise InitError(2, f"cannot create {out} ({exc.strerror or exc}); choose another path with -o") from None
    try:
        with f:
            f.write(text)
    except BaseException:
        os.unlink(out)  # ours, half written
        raise


def _exists(out: Path) -> InitError:
    return InitError(1, f"{out} exists; not overwritten. Write elsewhere with -o NEW.toml, or remove {out} first")


def command(args) -> int:
    try:
        if (args.gpus is not None and args.gpus < 0) or (args.gpu_memory is not None and args.gpu_memory <= 0):
            raise InitError(2, "--gpus takes 0 or more GPUs, --gpu-memory a positive number of GB")
        target = Path(args.target).expanduser().absolute()
        out = Path(args.output) if args.output else Path(f"{run_name(target)}.toml")
        if out.exists():
            raise _exists(out)
        facts, remote = _read_target(target)
        gpus, gpu_memory, source, gpu_name = _gpus(args)
        if gpus and facts.weight_bytes is None:
            raise InitError(
                2,
                f"no model.safetensors.index.json nor model.safetensors in {target}: the weights' size "
                "sizes the tensor parallelism; use a safetensors checkpoint (or --gpus 0 for CPU)",
            )
        args.warnings = []
        try:
            text = render(args, facts, remote, gpus, gpu_memory, source, out, gpu_name)
        except initplan.NoFit as exc:
            raise InitError(
                1, f"{exc}; no file written. Run on more or larger GPUs (--gpus N --gpu-memory GB describe them)"
            ) from None
        _check(text, out)
        _write(text, out)
    except InitError as exc:
        print(f"eyas init: {exc}", file=sys.stderr)
        return exc.code
    print(f"wrote {out}: {source}")
    for warning in args.warnings:
        print(f"eyas init: warning: {warning}", file=sys.stderr)
    print(f"next: eyas validate {out}; eyas doctor {out}; eyas submit {out} --follow")
    return 0
