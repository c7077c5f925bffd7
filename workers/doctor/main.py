"""`eyas doctor run.toml`: check a run before it starts, without loading a weight.

`python -m eyas.workers.doctor CONFIG [--json]` (doctor/__main__.py) is what the CLI execs (the
daemon side of eyas never imports torch); the preflight stage (stages/preflight.py) runs the
same `run_checks`. Checks, cheapest first so a broken install is reported in a second:
versions (versions.py) -> the data files prepare will read (data.py) ->
target config, weights on disk, TP sizes against the heads and experts, custom code (target.py) ->
layer ids -> GPUs (devices.py), memory (memory.py), a streaming run's shared GPUs (streaming.py),
disk and output dir (disk.py) ->
a Slurm run's clients and shared state directory (cluster.py) -> tokenizer and its chat
template (tokenizer.py) -> adapter fit against the backend's classes (adapter.py).
Exit status: 0 when nothing failed (warnings allowed), 1 when a check failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tomllib
from pathlib import Path

from eyas.state import runconfig as config
from eyas.workers.doctor import check
from eyas.workers.doctor.check import Check, failed

CONFIG_GROUP = "config"


def load_config(path: str) -> tuple[config.RunConfig | None, list[Check], list | None, bool]:
    """(config, checks for its mistakes, the layer ids as written, whether they were defaulted).

    Layer-id mistakes are the doctor's to explain (with the target's depth in plain words),
    so a config whose only mistakes are its layer ids is loaded without them and the ids
    as written are returned for the layer-id check. Any other mistake is a failed check each,
    and nothing else can be checked.
    """
    try:
        cfg = config.load(path)
    except config.ConfigError as exc:
        errors = exc.errors
    else:
        data = _toml(path)
        written = (data.get("extract") or {}).get("layer_ids") if isinstance(data.get("extract"), dict) else None
        return cfg, [], None, written is None
    layer_errors = [e for e in errors if ": extract.layer_ids: " in e]
    if layer_errors and len(layer_errors) == len(errors):
        data = _toml(path)
        written = data["extract"].pop("layer_ids")
        try:
            cfg = config.validate(data, Path(path).absolute().parent, path)
        except config.ConfigError as again:
            errors = again.errors
        else:
            return cfg, [], written, False
    checks = []
    for line in errors:
        where, _, rest = line.partition(": ")
        key, _, text = rest.partition(": ")
        problem, _, fix = text.partition("; ")
        if not text:  # a file-level error (unreadable, TOML syntax): "<file>: <problem>; <fix>"
            problem, _, fix = rest.partition("; ")
            key = "file"
        checks.append(failed(CONFIG_GROUP, key, problem, fix or f"fix {key} in {where}"))
    return None, checks, None, False


def _toml(path: str) -> dict:
    return tomllib.loads(Path(path).read_text(encoding="utf-8"))


def default_output_dir() -> str:
    """Where the daemon creates a run's outputs when output_dir is unset: runs/<id>/out under
    its state folder. The id is not known yet, so the runs folder stands for it."""
    from eyas.state.paths import runs_dir

    return str(runs_dir())


def run_checks(
    cfg: config.RunConfig, output_dir: str, layer_ids: list | tuple | None = None, defaulted: bool = False
) -> list[Check]:
    """Every check of a loaded config, in order. `layer_ids`: the ids as the user wrote them,
    when they differ from cfg's (see load_config)."""
    from eyas.workers.doctor import devices, disk, memory, target, versions

    checks: list[Check] = []
    uses_vllm = ("extract" in cfg.pipeline and cfg.extract.backend == "vllm") or bool(
        {"evaluate", "regenerate"} & set(cfg.pipeline)
    )
    checks += versions.check(needs_vllm=uses_vllm)
    if "prepare" in cfg.pipeline and cfg.data is not None:
        from eyas.workers.doctor import data

        checks += data.check(cfg.data)
    if cfg.target is None:
        return checks
    facts, found = target.read(cfg.target.path)
    checks += found
    if facts is None:
        return checks
    checks.append(target.weights(cfg, facts))
    tp = target.tensor_parallel(cfg, facts)
    if tp is not None:
        checks.append(tp)
    checks.append(target.remote_code(facts, cfg.target.trust_remote_code))
    ids = layer_ids if layer_ids is not None else cfg.extract.layer_ids
    if ids is not None and ("extract" in cfg.pipeline or layer_ids is not None):
        checks.append(target.layer_ids(ids, facts.num_layers, defaulted))

    gpus = devices.probe_gpus() if cfg.resources.devices != "cpu" else devices.Gpus(False, [])
    gpu_check, usable = devices.gpus(cfg, gpus)
    checks.append(gpu_check)
    from eyas.workers.doctor import streaming

    for extra in (
        memory.memory(cfg, facts.weight_bytes, usable, model=facts.config),
        streaming.check(cfg, facts.weight_bytes, usable, facts.config, len(ids or ())),
        disk.disk(cfg, output_dir, len(ids or ()), facts.hidden_size),
    ):
        if extra is not None:
            checks.append(extra)
    checks.append(disk.writable(output_dir))
    from eyas.workers.doctor import cluster

    checks += cluster.check(cfg)

    from eyas.workers.doctor import tokenizer

    renders = "prepare" in cfg.pipeline and (cfg.data is None or cfg.data.format != "tokenized")
    checks += tokenizer.check(cfg.target.path, cfg.target.trust_remote_code, facts.vocab_size, renders)
    if "extract" in cfg.pipeline:
        from eyas.workers.doctor import adapter

        checks += adapter.check(facts, cfg.extract.backend, cfg.target.trust_remote_code)
    return checks


def diagnose(path: str, output_dir: str | None = None) -> list[Check]:
    """Load the config at `path` and run every check it allows."""
    cfg, checks, written_ids, defaulted = load_config(path)
    if cfg is None:
        return checks
    out = output_dir or cfg.output_dir or default_output_dir()
    return checks + run_checks(cfg, out, written_ids, defaulted)


def canary_checks(path: str, before: list[Check]) -> list[Check]:
    """The extraction's canary, then the generation's when the run regenerates (doctor/canary.py)."""
    from eyas.workers.doctor import canary

    cfg, _, _, _ = load_config(path)
    if cfg is None:
        return [canary.check_without_config()]
    out = cfg.output_dir or default_output_dir()
    found = [canary.check(cfg, out, before)]
    generation = canary.check_generate(cfg, out, before + found)
    return found + ([generation] if generation is not None else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="eyas doctor",
        description="Check a run config, its target and this machine before the run starts, without loading weights.",
    )
    parser.add_argument("config", help="the run's TOML file")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument(
        "--canary",
        action="store_true",
        help="also run the canaries: the run's extraction engine and worker extension, and for a run that "
        "regenerates its generation engine, on a shrunken, dummy-weight copy of the target (tens of seconds each)",
    )
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    _quiet()
    checks = diagnose(args.config)
    if args.canary:
        checks += canary_checks(args.config, checks)
    if args.json:
        print(check.dumps(checks, config=os.path.abspath(args.config), seconds=round(time.monotonic() - t0, 3)))
    else:
        print(f"eyas doctor {args.config}")
        for line in check.table(checks):
            print(line)
    sys.stdout.flush()
    return check.exit_code(checks)


def _quiet() -> None:
    """The libraries the checks import log and warn on import (vLLM's platform banner,
    transformers' advice); the report is the doctor's only output."""
    import logging
    import warnings

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
