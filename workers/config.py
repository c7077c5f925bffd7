"""The run configuration: one TOML file, checked in full before anything starts.

`load()` reads the TOML, `validate()` checks it and returns a frozen `RunConfig`; every mistake
found is reported at once, one line each (`<file>: <key>: <problem>; <fix>`), so a user fixes a
config in one round instead of one error per submit. Workers get the resolved config back as
JSON (`RunConfig.to_dict()` / `RunConfig.from_dict()`).

Pure stdlib: the daemon imports this module, so it must never pull in torch. config.json of the
target is read with `json`, not transformers, for the same reason.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from eyas.workers.specs import DEFAULT_PIPELINE, STAGES

DTYPES = ("float32", "float16", "bfloat16")
DATA_FORMATS = ("auto", "sharegpt", "openai", "tokenized")
BACKENDS = ("hf", "vllm")
STRATEGIES = ("ddp", "fsdp")
DEFAULT_BACKOFF = 2.0
_NAME_CHARS = re.compile(r"[A-Za-z0-9._-]+")


class ConfigError(ValueError):
    """Every mistake found in a config, one line each."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


@dataclass(frozen=True)
class TargetConfig:
    path: str                       # absolute
    dtype: str = "bfloat16"
    trust_remote_code: bool = False


@dataclass(frozen=True)
class DataConfig:
    path: str                       # absolute; a file or a directory
    format: str = "auto"
    max_length: int = 2048
    limit: int = 0                  # 0: no limit
    validation_fraction: float = 0.05


@dataclass(frozen=True)
class ExtractConfig:
    backend: str = "hf"
    # Resolved from the target's depth when the file names none (None only without a target).
    layer_ids: tuple[int, ...] | None = None
    tensor_parallel_size: int = 1
    batch_size: int = 8


@dataclass(frozen=True)
class ResourcesConfig:
    ranks: int = 1
    devices: str | tuple[int, ...] = "auto"     # "auto", "cpu" or GPU indices


@dataclass(frozen=True)
class DraftConfig:
    vocab_size: int = 32000
    num_layers: int = 1
    ttt_steps: int = 3


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 3
    lr: float = 1e-4
    batch_tokens: int = 8192
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    noise_std: float = 0.0
    seed: int = 0
    strategy: str = "ddp"


@dataclass(frozen=True)
class EvaluateConfig:
    """[evaluate]: the draft's acceptance in vLLM (workers/stages/evaluate.py)."""

    num_speculative_tokens: int = 3     # k: draft tokens proposed per target forward
    max_tokens: int = 128               # greedy tokens generated per prompt
    max_prompts: int = 128              # the first N prompts; 0: all of them
    prompts: str | None = None          # absolute; a JSONL prompt file; None: prepare's validation split
    batch_size: int = 16                # sequences vLLM runs at once (max_num_seqs)
    # None only before validation: it then defaults to extract.tensor_parallel_size.
    tensor_parallel_size: int | None = None


LOG_MAX_MB = 512   # stages.<name>.log_max_mb's default; the daemon hands each rank its bound


@dataclass(frozen=True)
class StageConfig:
    max_restarts: int | None = None     # None: the stage spec's default
    backoff: float = DEFAULT_BACKOFF    # seconds before the first restart, doubled each time
    # The hang bounds (daemon/watchdog.py), in seconds; 0 turns one off, None takes the stage
    # spec's default. stall_timeout: nothing written for this long; exit_timeout: a rank still
    # alive this long after its own work or its peers ended.
    stall_timeout: float | None = None
    exit_timeout: float | None = None
    # Each rank log's bound in MiB (state/logcut.py): past it the middle is cut; 0: unbounded.
    log_max_mb: float = LOG_MAX_MB
    ranks: int | None = None            # None: resources.ranks
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunConfig:
    name: str
    output_dir: str | None = None       # None: the daemon picks <state>/runs/<id>/out
    pipeline: tuple[str, ...] = DEFAULT_PIPELINE
    target: TargetConfig | None = None
    data: DataConfig | None = None
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    stages: dict[str, StageConfig] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only (tuples become lists); paths are already absolute."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        """Rebuild a config from `to_dict()`. No checks: it was validated when submitted,
        and the paths may live on another host's view of the filesystem."""
        ex = dict(d.get("extract") or {})
        if ex.get("layer_ids") is not None:
            ex["layer_ids"] = tuple(ex["layer_ids"])
        res = dict(d.get("resources") or {})
        if isinstance(res.get("devices"), list):
            res["devices"] = tuple(res["devices"])
        return cls(
            name=d["name"],
            output_dir=d.get("output_dir"),
            pipeline=tuple(d.get("pipeline") or DEFAULT_PIPELINE),
            target=TargetConfig(**d["target"]) if d.get("target") else None,
            data=DataConfig(**d["data"]) if d.get("data") else None,
            extract=ExtractConfig(**ex),
            resources=ResourcesConfig(**res),
            draft=DraftConfig(**(d.get("draft") or {})),
            train=TrainConfig(**(d.get("train") or {})),
            evaluate=EvaluateConfig(**(d.get("evaluate") or {})),
            stages={k: StageConfig(**v) for k, v in (d.get("stages") or {}).items()},
        )


def stage_world_size(cfg: RunConfig, stage: str) -> int:
    """How many ranks the daemon starts for `stage`."""
    if not STAGES[stage].distributed:
        return 1
    override = cfg.stages.get(stage)
    if override is not None and override.ranks is not None:
        return override.ranks
    return cfg.resources.ranks


def stage_settings(cfg: RunConfig, stage: str) -> tuple[int, float, dict[str, Any]]:
    """(max_restarts, backoff seconds, options) of `stage`, defaults filled in."""
    sc = cfg.stages.get(stage) or StageConfig()
    restarts = STAGES[stage].max_restarts if sc.max_restarts is None else sc.max_restarts
    return restarts, sc.backoff, dict(sc.options)


def default_layer_ids(n: int) -> tuple[int, ...]:
    """[2, N//2, N-3, N] (EAGLE-3's low, middle, high layers plus the last hidden state),
    clipped to 0..N and deduplicated so that shallow test targets still get a valid list."""
    return tuple(sorted({min(max(i, 0), n) for i in (2, n // 2, n - 3, n)}))


def read_model_config(target_path: str | os.PathLike) -> dict[str, Any]:
    """The target's config.json as a dict (OSError / json.JSONDecodeError on a bad file)."""
    with open(Path(target_path) / "config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ValueError("config.json does not hold a JSON object")
    return cfg


def text_value(model_cfg: dict[str, Any], key: str) -> Any:
    """`key` of the language model: multimodal wrappers (e.g. KimiK25ForConditionalGeneration)
    keep it under text_config."""
    if key in model_cfg:
        return model_cfg[key]
    text = model_cfg.get("text_config")
    return text.get(key) if isinstance(text, dict) else None


def num_hidden_layers(target_path: str | os.PathLike) -> int:
    """The target's decoder depth N, from config.json (or its text_config)."""
    n = text_value(read_model_config(target_path), "num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError("config.json has no num_hidden_layers (nor text_config.num_hidden_layers)")
    return n


# --- checking -------------------------------------------------------------------------------

_BAD = object()     # a value that failed its check: the field keeps its default, checks go on

_TOML_TYPES = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array", dict: "table"}


def _describe(value: Any) -> str:
    """`string '1e-4x'`, `integer 3`, `table`: how the TOML value looks to its author."""
    kind = _TOML_TYPES.get(type(value), type(value).__name__)
    if isinstance(value, dict):
        return "a table"
    # JSON spells booleans and arrays the way TOML does (true, [1, 2]); repr quotes strings 'so'.
    shown = json.dumps(value, default=str) if isinstance(value, (bool, list)) else repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"{kind} {shown}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)     # TOML true is not 1


def _choices(choices: tuple[str, ...] | list[str]) -> str:
    return ", ".join(choices)


class _Checker:
    """Collects error lines instead of raising, so that one pass reports them all."""

    def __init__(self, source: str, base_dir: Path):
        self.source = source
        self.base_dir = base_dir
        self.errors: list[str] = []

    def error(self, key: str, text: str) -> None:
        self.errors.append(f"{self.source}: {key}: {text}")

    def unknown_keys(self, table: dict, prefix: str, allowed: list[str]) -> None:
        for key in table:
            if key in allowed:
                continue
            full = f"{prefix}{key}"
            close = difflib.get_close_matches(str(key), allowed, n=1)
            if close:
                self.error(full, f"unknown key; did you mean '{prefix}{close[0]}'?")
            else:
                self.error(full, f"unknown key; valid keys: {_choices(allowed)}")

    def table(self, data: dict, key: str, allowed: list[str]) -> dict | None:
        """The sub-table `key` of `data` with its unknown keys reported; None if absent or bad."""
        if key not in data:
            return None
        value = data[key]
        if not isinstance(value, dict):
            self.error(key, f"expected a table, got {_describe(value)}; write it as [{key}]")
            return None
        self.unknown_keys(value, f"{key}.", allowed)
        return value

    # Field checkers: (key, value, ...) -> the value, or _BAD after recording the error.

    def integer(self, key: str, v: Any, lo: int, hi: int | None = None) -> Any:
        if not _is_int(v):
            self.error(key, f"expected an integer, got {_describe(v)}")
            return _BAD
        if hi is None and v < lo:
            self.error(key, f"{v} is out of range; use an integer >= {lo}")
            return _BAD
        if hi is not None and not lo <= v <= hi:
            self.error(key, f"{v} is out of range {lo}..{hi}; use an integer from {lo} to {hi}")
            return _BAD
        return v

    def number(self, key: str, v: Any, lo: float, hi: float | None = None,
               lo_open: bool = False, hi_open: bool = True) -> Any:
        if not (_is_int(v) or isinstance(v, float)):
            self.error(key, f"expected a number, got {_describe(v)}")
            return _BAD
        ok = math.isfinite(v) and (v > lo if lo_open else v >= lo)
        if hi is not None:
            ok = ok and (v < hi if hi_open else v <= hi)
        if not ok:
            bounds = f"{'>' if lo_open else '>='} {lo:g}"
            if hi is not None:
                bounds += f" and {'<' if hi_open else '<='} {hi:g}"
            self.error(key, f"{v!r} is out of range; use a number {bounds}")
            return _BAD
        return float(v)

    def choice(self, key: str, v: Any, choices: tuple[str, ...]) -> Any:
        if not isinstance(v, str):
            self.error(key, f"expected a string, got {_describe(v)}; use one of: {_choices(choices)}")
            return _BAD
        if v not in choices:
            close = difflib.get_close_matches(v, choices, n=1)
            hint = f"did you mean '{close[0]}'? (one of: {_choices(choices)})" if close else \
                f"use one of: {_choices(choices)}"
            self.error(key, f"unknown value '{v}'; {hint}")
            return _BAD
        return v

    def boolean(self, key: str, v: Any) -> Any:
        if not isinstance(v, bool):
            self.error(key, f"expected true or false, got {_describe(v)}")
            return _BAD
        return v

    def path(self, key: str, v: Any) -> Any:
        """An absolute path: relative ones count from the TOML file's folder."""
        if not isinstance(v, str):
            self.error(key, f"expected a path string, got {_describe(v)}")
            return _BAD
        if not v.strip():
            self.error(key, "empty; write a path, relative to this file's folder or absolute")
            return _BAD
        return os.path.normpath(self.base_dir / Path(v).expanduser())

    def fields(self, table: dict | None, section: str, rules: dict[str, Callable]) -> dict[str, Any]:
        """Check each present key of `table` with its rule; keep only the good values."""
        out = {}
        for key, rule in rules.items():
            if table is not None and key in table:
                value = rule(f"{section}.{key}", table[key])
                if value is not _BAD:
                    out[key] = value
        return out


def _allowed(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


# `preflight = false` turns off the preflight stage that validation puts first (see _with_preflight);
# it is read here only, so RunConfig keeps no field for it.
_TOP_KEYS = _allowed(RunConfig) + ["preflight"]


def _check_name(ck: _Checker, data: dict) -> str:
    if "name" not in data:
        ck.error("name", 'missing; add name = "my-run" at the top of the file')
        return ""
    name = data["name"]
    if not isinstance(name, str):
        ck.error("name", f"expected a string, got {_describe(name)}")
    elif not name:
        ck.error("name", 'empty; write a short name like "my-run"')
    elif len(name) > 80:
        ck.error("name", f"{len(name)} characters is too long; use at most 80")
    elif not _NAME_CHARS.fullmatch(name):
        fixed = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "my-run"
        ck.error("name", f"'{name}' may only hold letters, digits, '.', '_' and '-'; e.g. '{fixed}'")
    else:
        return name
    return ""


def _check_pipeline(ck: _Checker, data: dict) -> tuple[str, ...]:
    """The pipeline, keeping only known stages so that later checks still run."""
    if "pipeline" not in data:
        return DEFAULT_PIPELINE
    value = data["pipeline"]
    if not isinstance(value, list):
        ck.error("pipeline", f"expected an array of stage names, got {_describe(value)}")
        return DEFAULT_PIPELINE
    if not value:
        ck.error("pipeline", f"empty; list at least one stage, e.g. {json.dumps(list(DEFAULT_PIPELINE))}")
    names = list(STAGES)
    out: list[str] = []
    for item in value:
        if not isinstance(item, str):
            ck.error("pipeline", f"expected stage names, got {_describe(item)}")
        elif item not in STAGES:
            close = difflib.get_close_matches(item, names, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"choose from {_choices(names)}"
            ck.error("pipeline", f"unknown stage '{item}'; {hint}")
        elif item in out:
            ck.error("pipeline", f"'{item}' is listed twice; list each stage once")
        else:
            out.append(item)
    return tuple(out)


def _with_preflight(ck: _Checker, data: dict, pipeline: tuple[str, ...]) -> tuple[str, ...]:
    """The pipeline with "preflight" (eyas doctor's checks) first when any stage reads the target,
    unless the user placed it themselves or set `preflight = false`. Pipelines of stages that need
    no target (selftest) get none."""
    wanted = ck.boolean("preflight", data["preflight"]) if "preflight" in data else True
    if wanted is False and "preflight" in pipeline:
        ck.error("preflight", "false, but pipeline lists \"preflight\"; remove it from pipeline or drop this key")
    if wanted is not True or "preflight" in pipeline:
        return pipeline
    if any(STAGES[s].needs_target for s in pipeline):
        return ("preflight", *pipeline)
    return pipeline


def layer_id_errors(value: Any, n: int | None) -> list[str]:
    """What is wrong with a list of layer ids for an `n`-layer target, one "problem; fix" line
    each (the checks `validate` runs on extract.layer_ids); [] when nothing is."""
    ck = _Checker("", Path("."))
    _check_layer_ids(ck, value, n)
    return [e.removeprefix(": extract.layer_ids: ") for e in ck.errors]


def _stages_phrase(stages: list[str]) -> str:
    """'stage prepare reads' / 'stages extract, train read'."""
    if len(stages) == 1:
        return f"stage {stages[0]} reads"
    return f"stages {', '.join(stages)} read"


def _check_target(ck: _Checker, data: dict, pipeline: tuple[str, ...]):
    """(TargetConfig | None, the target's config.json dict | None)."""
    readers = [s for s in pipeline if STAGES[s].needs_target]
    table = ck.table(data, "target", _allowed(TargetConfig))
    if table is None:
        if "target" not in data and readers:
            ck.error("target", f"missing ({_stages_phrase(readers)} the target model); "
                               'add a [target] table with path = "<model directory>"')
        return None, None
    values = ck.fields(table, "target", {
        "path": ck.path,
        "dtype": lambda k, v: ck.choice(k, v, DTYPES),
        "trust_remote_code": ck.boolean,
    })
    if "path" not in table:
        ck.error("target.path", "missing; set it to the target model's directory (the one with config.json)")
    if "path" not in values:
        return None, None
    path = values["path"]
    fix = "point it at a model directory with config.json"
    model_cfg = None
    if not os.path.exists(path):
        ck.error("target.path", f"{path} does not exist; {fix}")
    elif not os.path.isdir(path):
        ck.error("target.path", f"{path} is not a directory; {fix}")
    elif not os.path.isfile(os.path.join(path, "config.json")):
        ck.error("target.path", f"{path} has no config.json; {fix}")
    else:
        try:
            model_cfg = read_model_config(path)
            num_hidden_layers(path)
        except (OSError, ValueError) as exc:    # JSONDecodeError is a ValueError
            ck.error("target.path", f"{path}/config.json is unusable ({exc}); {fix}")
            model_cfg = None
    return TargetConfig(**values), model_cfg


def _check_data(ck: _Checker, data: dict, pipeline: tuple[str, ...]) -> DataConfig | None:
    readers = [s for s in pipeline if STAGES[s].needs_data]
    table = ck.table(data, "data", _allowed(DataConfig))
    if table is None:
        if "data" not in data and readers:
            ck.error("data", f"missing ({_stages_phrase(readers)} the dataset); "
                             'add a [data] table with path = "<chat .jsonl file or directory>"')
        return None
    values = ck.fields(table, "data", {
        "path": ck.path,
        "format": lambda k, v: ck.choice(k, v, DATA_FORMATS),
        "max_length": lambda k, v: ck.integer(k, v, 16, 1_048_576),
        "limit": lambda k, v: ck.integer(k, v, 0),
        "validation_fraction": lambda k, v: ck.number(k, v, 0.0, 1.0),
    })
    if "path" not in table:
        ck.error("data.path", "missing; set it to the dataset (a .jsonl file or a directory)")
    if "path" not in values:
        return None
    if not os.path.exists(values["path"]):
        ck.error("data.path", f"{values['path']} does not exist; point it at a .jsonl file or a directory")
    return DataConfig(**values)


def _check_layer_ids(ck: _Checker, value: Any, n: int | None) -> Any:
    key = "extract.layer_ids"
    if not isinstance(value, list):
        ck.error(key, f"expected an array of layer ids, got {_describe(value)}")
        return _BAD
    bad = [v for v in value if not _is_int(v)]
    if bad:
        ck.error(key, f"expected integers, got {_describe(bad[0])}")
        return _BAD
    ok = True
    if len(value) < 2:
        ck.error(key, f"{len(value)} id given; list at least 2 (EAGLE-3 fuses several layers), "
                      "e.g. [2, N//2, N-3, N]")
        ok = False
    for v in value:
        if n is not None and not 0 <= v <= n:
            ck.error(key, f"{v} is out of range 0..{n} for a {n}-layer target; "
                          f"use ids from 0 to {n} ({n} is the final pre-norm output)")
            ok = False
        elif v < 0:
            ck.error(key, f"{v} is out of range; layer ids count from 0")
            ok = False
    # The suggested fix keeps only the ids that are in range.
    fixed = sorted({v for v in value if v >= 0 and (n is None or v <= n)})
    seen = set()
    for v in value:
        if v in seen:
            ck.error(key, f"{v} is listed twice; list each id once, e.g. {fixed}")
            ok = False
        seen.add(v)
    if len(seen) == len(value) and value != sorted(value):
        ck.error(key, f"{value} is not in ascending order; write {fixed}")
        ok = False
    return tuple(value) if ok else _BAD


def _check_devices(ck: _Checker, key: str, v: Any) -> Any:
    fix = 'use "auto", "cpu" or a list of GPU indices like [0, 1]'
    if isinstance(v, str):
        if v in ("auto", "cpu"):
            return v
        ck.error(key, f"unknown value '{v}'; {fix}")
        return _BAD
    if not isinstance(v, list):
        ck.error(key, f"expected \"auto\", \"cpu\" or a list of GPU indices, got {_describe(v)}")
        return _BAD
    if not v:
        ck.error(key, f"empty; {fix}")
        return _BAD
    ok, seen = True, set()
    for d in v:
        if not _is_int(d):
            ck.error(key, f"expected GPU indices (integers), got {_describe(d)}")
            ok = False
        elif d < 0:
            ck.error(key, f"{d} is not a GPU index; use non-negative integers like [0, 1]")
            ok = False
        elif d in seen:
            ck.error(key, f"{d} is listed twice; list each GPU once")
            ok = False
        else:
            seen.add(d)
    return tuple(v) if ok else _BAD


def _check_stages(ck: _Checker, data: dict, pipeline: tuple[str, ...]) -> dict[str, StageConfig]:
    if "stages" not in data:
        return {}
    table = data["stages"]
    if not isinstance(table, dict):
        ck.error("stages", f"expected a table, got {_describe(table)}; write [stages.<name>] tables")
        return {}
    out = {}
    for name, sub in table.items():
        key = f"stages.{name}"
        if name not in pipeline:
            if name in STAGES:
                ck.error(key, f"'{name}' is not in the pipeline; add it to pipeline or remove [{key}]")
            else:
                close = difflib.get_close_matches(name, list(pipeline), n=1)
                hint = f"did you mean 'stages.{close[0]}'?" if close else \
                    f"the pipeline's stages are: {_choices(pipeline)}"
                ck.error(key, f"unknown stage; {hint}")
            continue
        if not isinstance(sub, dict):
            ck.error(key, f"expected a table, got {_describe(sub)}; write it as [{key}]")
            continue
        ck.unknown_keys(sub, f"{key}.", _allowed(StageConfig))
        values = ck.fields(sub, key, {
            "max_restarts": lambda k, v: ck.integer(k, v, 0, 100),
            "backoff": lambda k, v: ck.number(k, v, 0.0),
            "stall_timeout": lambda k, v: ck.number(k, v, 0.0),
            "exit_timeout": lambda k, v: ck.number(k, v, 0.0),
            "log_max_mb": lambda k, v: ck.number(k, v, 0.0),
            "ranks": lambda k, v: ck.integer(k, v, 1),
            "options": _check_options(ck),
        })
        if "ranks" in sub and not STAGES[name].distributed:
            ck.error(f"{key}.ranks", f"{name} always runs as one rank; remove this key")
            values.pop("ranks", None)
        out[name] = StageConfig(**values)
    return out


def _check_options(ck: _Checker) -> Callable:
    def check(key: str, v: Any) -> Any:
        if not isinstance(v, dict):
            ck.error(key, f"expected a table, got {_describe(v)}; write it as {{ key = value, ... }}")
            return _BAD
        try:
            # The options reach the stage through the run's config JSON.
            json.dumps(v)
        except TypeError:
            ck.error(key, "holds a date or time, which cannot be passed to a stage; quote it as a string")
            return _BAD
        return dict(v)
    return check


def _check_evaluate(ck: _Checker, data: dict, pipeline: tuple[str, ...], data_cfg: DataConfig | None,
                    extract_tp: int, devices: Any) -> EvaluateConfig:
    """[evaluate], with tensor_parallel_size defaulting to the run's (extract's) TP size."""
    table = ck.table(data, "evaluate", _allowed(EvaluateConfig))
    values = ck.fields(table, "evaluate", {
        "num_speculative_tokens": lambda k, v: ck.integer(k, v, 1, 16),
        "max_tokens": lambda k, v: ck.integer(k, v, 1, 65536),
        "max_prompts": lambda k, v: ck.integer(k, v, 0),
        "prompts": ck.path,
        "batch_size": lambda k, v: ck.integer(k, v, 1, 4096),
        "tensor_parallel_size": lambda k, v: ck.integer(k, v, 1),
    })
    prompts = values.get("prompts")
    if prompts is not None and not os.path.isfile(prompts):
        what = "is a directory" if os.path.isdir(prompts) else "does not exist"
        ck.error("evaluate.prompts", f"{prompts} {what}; point it at a JSONL file of prompts, or remove the key "
                                     "to prompt with prepare's validation rows")
        values.pop("prompts")
    elif (prompts is None and "prompts" not in (table or {}) and "evaluate" in pipeline and data_cfg is not None
          and data_cfg.validation_fraction == 0):
        ck.error("evaluate.prompts", "missing, and data.validation_fraction = 0 holds no rows out to prompt with; "
                                     "set data.validation_fraction > 0 or evaluate.prompts to a JSONL prompt file")
    # A default taken from extract was checked there (it can exceed the devices only with backend
    # "vllm", which reports it); only a size set here is checked here.
    explicit = "tensor_parallel_size" in values
    tp = values.setdefault("tensor_parallel_size", extract_tp)
    if explicit and "evaluate" in pipeline and isinstance(devices, tuple) and tp > len(devices):
        ck.error("evaluate.tensor_parallel_size", f"{tp} needs {tp} GPUs but resources.devices lists "
                                                  f"{len(devices)}; list {tp} devices or lower it")
    return EvaluateConfig(**values)


def validate(data: dict[str, Any], base_dir: str | os.PathLike, source: str) -> RunConfig:
    """Check a parsed TOML document; raise ConfigError listing every mistake."""
    ck = _Checker(source, Path(base_dir).absolute())
    ck.unknown_keys(data, "", _TOP_KEYS)
    name = _check_name(ck, data)
    output_dir = ck.path("output_dir", data["output_dir"]) if "output_dir" in data else None
    if output_dir is _BAD:
        output_dir = None
    elif output_dir is not None and os.path.exists(output_dir) and not os.path.isdir(output_dir):
        ck.error("output_dir", f"{output_dir} is a file; point it at a directory (it is created if missing)")
    pipeline = _check_pipeline(ck, data)
    target, model_cfg = _check_target(ck, data, pipeline)
    data_cfg = _check_data(ck, data, pipeline)
    pipeline = _with_preflight(ck, data, pipeline)
    n_layers = text_value(model_cfg, "num_hidden_layers") if model_cfg else None

    extract_t = ck.table(data, "extract", _allowed(ExtractConfig))
    extract = ck.fields(extract_t, "extract", {
        "backend": lambda k, v: ck.choice(k, v, BACKENDS),
        "layer_ids": lambda k, v: _check_layer_ids(ck, v, n_layers),
        "tensor_parallel_size": lambda k, v: ck.integer(k, v, 1),
        "batch_size": lambda k, v: ck.integer(k, v, 1),
    })
    if "layer_ids" not in (extract_t or {}) and n_layers is not None:
        extract["layer_ids"] = default_layer_ids(n_layers)

    resources = ck.fields(ck.table(data, "resources", _allowed(ResourcesConfig)), "resources", {
        "ranks": lambda k, v: ck.integer(k, v, 1, 1024),
        "devices": lambda k, v: _check_devices(ck, k, v),
    })
    draft_t = ck.table(data, "draft", _allowed(DraftConfig))
    draft = ck.fields(draft_t, "draft", {
        "vocab_size": lambda k, v: ck.integer(k, v, 1),
        "num_layers": lambda k, v: ck.integer(k, v, 1, 8),
        "ttt_steps": lambda k, v: ck.integer(k, v, 1, 16),
    })
    train = ck.fields(ck.table(data, "train", _allowed(TrainConfig)), "train", {
        "epochs": lambda k, v: ck.integer(k, v, 1),
        "lr": lambda k, v: ck.number(k, v, 0.0, 1.0, lo_open=True),
        "batch_tokens": lambda k, v: ck.integer(k, v, 16),
        "warmup_steps": lambda k, v: ck.integer(k, v, 0),
        "weight_decay": lambda k, v: ck.number(k, v, 0.0),
        "grad_clip": lambda k, v: ck.number(k, v, 0.0, lo_open=True),
        "noise_std": lambda k, v: ck.number(k, v, 0.0),
        "seed": lambda k, v: ck.integer(k, v, 0, 2**32 - 1),   # numpy's seed range
        "strategy": lambda k, v: ck.choice(k, v, STRATEGIES),
    })
    stages = _check_stages(ck, data, pipeline)

    # Checks across keys, only between values that passed their own checks (a rejected value
    # has already been reported; its default must not raise a second, misleading error).
    def good(table: dict | None, values: dict, key: str) -> bool:
        return key in values or key not in (table or {})

    tp = extract.get("tensor_parallel_size", 1)
    backend = extract.get("backend", "hf") if good(extract_t, extract, "backend") else None
    if tp > 1 and backend == "hf":
        ck.error("extract.tensor_parallel_size",
                 f'{tp} needs backend "vllm"; set extract.backend = "vllm" or tensor_parallel_size = 1')
    devices = resources.get("devices")
    if isinstance(devices, tuple) and tp > len(devices) and backend == "vllm":
        ck.error("extract.tensor_parallel_size",
                 f"{tp} needs {tp} GPUs but resources.devices lists {len(devices)}; "
                 f"list {tp} devices or lower tensor_parallel_size")
    target_vocab = text_value(model_cfg, "vocab_size") if model_cfg else None
    vocab = draft.get("vocab_size", DraftConfig.vocab_size)
    # The default draft vocab matters only to stages that build or train a draft.
    uses_draft = {"vocab", "train", "evaluate"} & set(pipeline) or "vocab_size" in (draft_t or {})
    if uses_draft and _is_int(target_vocab) and good(draft_t, draft, "vocab_size") and vocab > target_vocab:
        ck.error("draft.vocab_size",
                 f"{vocab} exceeds the target's vocabulary ({target_vocab}); use at most {target_vocab}")
    evaluate = _check_evaluate(ck, data, pipeline, data_cfg, tp if good(extract_t, extract, "tensor_parallel_size")
                               else 1, devices)

    if ck.errors:
        raise ConfigError(ck.errors)
    return RunConfig(
        name=name, output_dir=output_dir, pipeline=pipeline, target=target, data=data_cfg,
        extract=ExtractConfig(**extract), resources=ResourcesConfig(**resources),
        draft=DraftConfig(**draft), train=TrainConfig(**train), evaluate=evaluate, stages=stages,
    )


_TOML_WHERE = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")


def load(path: str | os.PathLike) -> RunConfig:
    """Read and check a run's TOML file; relative paths in it count from its folder."""
    source = os.fspath(path)
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError([f"{source}: cannot read the file ({exc.strerror or exc}); check the path"])
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{source}: byte {exc.start}: not UTF-8 text; save the file as UTF-8"])
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib (3.11) puts the position only in the message: "(at line 3, column 5)" or
        # "(at end of document)", which is the last line.
        msg = str(exc)
        m = _TOML_WHERE.search(msg)
        if m:
            where, msg = f"line {m.group(1)}, column {m.group(2)}", msg[:m.start()]
        else:
            where = f"line {max(1, len(text.splitlines()))} (end of file)"
            msg = msg.replace(" (at end of document)", "")
        raise ConfigError([f"{source}: {where}: TOML syntax error: {msg}; fix the syntax there "
                           "(see https://toml.io)"])
    return validate(data, Path(path).absolute().parent, source)
