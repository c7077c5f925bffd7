"""The run config: TOML in, a frozen RunConfig out, or every mistake as one exact line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import eyas.workers
from eyas.state import runconfig as config
from eyas.state.drafttables import DraftConfig, EvaluateConfig, ExtractConfig, TrainConfig
from eyas.state.executiontables import ResourcesConfig, StageConfig
from eyas.state.inputtables import DataConfig, TargetConfig
from eyas.state.runconfig import ConfigError, RunConfig, load, stage_options, stage_settings, stage_world_size
from eyas.state.specs import DEFAULT_PIPELINE
from eyas.state.target import default_layer_ids, num_hidden_layers

EXAMPLES = Path(eyas.workers.__file__).parent / "examples"
# The console script of the venv running the tests (/work/main/.venv/bin/eyas here).
EYAS = str(Path(sys.executable).parent / "eyas")

BASE = """
name = "t"
[target]
path = "model"
[data]
path = "chat.jsonl"
"""


def make_target(path: Path, layers: int = 8, vocab: int = 1000, wrapped: bool = False) -> Path:
    """A fake model directory: only config.json, which is all the config checks read."""
    path.mkdir(parents=True, exist_ok=True)
    text = {"num_hidden_layers": layers, "vocab_size": vocab, "hidden_size": 64}
    cfg = (
        {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": text}
        if wrapped
        else {"architectures": ["DeepseekV3ForCausalLM"], **text}
    )
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A folder holding model/ (8 layers, vocab 1000) and chat.jsonl; the cwd, so that
    load("run.toml") reports its source as "run.toml"."""
    make_target(tmp_path / "model")
    (tmp_path / "chat.jsonl").write_text('{"messages": []}\n')
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def big_run_dir(run_dir):
    """The target gets a vocabulary large enough for the default draft."""
    make_target(run_dir / "model", layers=8, vocab=50000)
    return run_dir


def errors(text: str) -> list[str]:
    Path("run.toml").write_text(text)
    with pytest.raises(ConfigError) as exc:
        load("run.toml")
    assert str(exc.value) == "\n".join(exc.value.errors)
    return exc.value.errors


def loads(text: str) -> RunConfig:
    Path("run.toml").write_text(text)
    return load("run.toml")


FULL = """
name = "full.run-1"
output_dir = "out/full"
pipeline = ["prepare", "extract", "train"]

[target]
path = "model"
dtype = "float16"
trust_remote_code = true

[data]
path = "chat.jsonl"
format = "sharegpt"
max_length = 512
limit = 100
validation_fraction = 0.1

[extract]
backend = "vllm"
layer_ids = [1, 3, 8]
tensor_parallel_size = 2
batch_size = 4

[resources]
ranks = 4
devices = [0, 1, 2, 3]

[draft]
vocab_size = 500
num_layers = 2
ttt_steps = 5

[train]
epochs = 1
lr = 3e-4
batch_tokens = 4096
warmup_steps = 10
weight_decay = 0.01
grad_clip = 0.5
noise_std = 0.05
seed = 7
strategy = "fsdp"

[stages.extract]
ranks = 1
max_restarts = 2
backoff = 0.5

[stages.train]
options = { scheduler = "cosine", save_every = 50 }
"""


def test_full_config_loads_every_key_and_round_trips(run_dir):
    cfg = loads(FULL)
    assert cfg == RunConfig(
        name="full.run-1",
        output_dir=str(run_dir / "out" / "full"),
        pipeline=("preflight", "prepare", "extract", "train"),  # preflight: put first by validation
        target=TargetConfig(path=str(run_dir / "model"), dtype="float16", trust_remote_code=True),
        data=DataConfig(
            path=str(run_dir / "chat.jsonl"), format="sharegpt", max_length=512, limit=100, validation_fraction=0.1
        ),
        extract=ExtractConfig(backend="vllm", layer_ids=(1, 3, 8), tensor_parallel_size=2, batch_size=4),
        resources=ResourcesConfig(ranks=4, devices=(0, 1, 2, 3)),
        draft=DraftConfig(vocab_size=500, num_layers=2, ttt_steps=5),
        train=TrainConfig(
            epochs=1,
            lr=3e-4,
            batch_tokens=4096,
            warmup_steps=10,
            weight_decay=0.01,
            grad_clip=0.5,
            noise_std=0.05,
            seed=7,
            strategy="fsdp",
        ),
        evaluate=EvaluateConfig(tensor_parallel_size=2),  # extract's, when [evaluate] names none
        stages={
            "extract": StageConfig(max_restarts=2, backoff=0.5, ranks=1),
            "train": StageConfig(options={"scheduler": "cosine", "save_every": 50}),
        },
    )
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["extract"]["layer_ids"] == [1, 3, 8]
    assert d["resources"]["devices"] == [0, 1, 2, 3]
    assert d["target"]["path"] == str(run_dir / "model")
    assert RunConfig.from_dict(json.loads(json.dumps(d))) == cfg

    assert [stage_world_size(cfg, s) for s in cfg.pipeline] == [1, 1, 1, 4]
    assert stage_settings(cfg, "extract") == (2, 0.5, {})
    assert stage_settings(cfg, "train") == (0, 2.0, {"scheduler": "cosine", "save_every": 50})
    assert stage_settings(cfg, "prepare") == (0, 2.0, {})


def test_minimal_config_gets_the_defaults(big_run_dir):
    run_dir = big_run_dir
    cfg = loads(BASE)
    assert cfg == RunConfig(
        name="t",
        output_dir=None,
        pipeline=("preflight", *DEFAULT_PIPELINE),
        target=TargetConfig(path=str(run_dir / "model"), dtype="bfloat16", trust_remote_code=False),
        data=DataConfig(
            path=str(run_dir / "chat.jsonl"), format="auto", max_length=2048, limit=0, validation_fraction=0.05
        ),
        extract=ExtractConfig(backend="hf", layer_ids=(2, 4, 5, 8), tensor_parallel_size=1, batch_size=8),
        resources=ResourcesConfig(ranks=1, devices="auto"),
        draft=DraftConfig(vocab_size=32000, num_layers=1, ttt_steps=3),
        train=TrainConfig(
            epochs=3,
            lr=1e-4,
            batch_tokens=8192,
            warmup_steps=0,
            weight_decay=0.0,
            grad_clip=1.0,
            noise_std=0.0,
            seed=0,
            strategy="ddp",
        ),
        evaluate=EvaluateConfig(
            num_speculative_tokens=3,
            max_tokens=128,
            max_prompts=256,
            prompts=None,
            batch_size=16,
            tensor_parallel_size=1,
        ),
        stages={},
    )


def test_default_draft_vocab_larger_than_the_target_is_refused(run_dir):
    # The fake target's vocabulary is 1000: the 32000 default cannot fit.
    assert errors(BASE) == [
        "run.toml: draft.vocab_size: 32000 exceeds the target's vocabulary (1000); use at most 1000",
    ]


def test_default_layer_ids():
    assert default_layer_ids(61) == (2, 30, 58, 61)
    assert default_layer_ids(8) == (2, 4, 5, 8)
    assert default_layer_ids(4) == (1, 2, 4)  # shallow test targets still get ascending ids
    assert default_layer_ids(1) == (0, 1)


def test_layer_ids_default_from_a_multimodal_wrappers_text_config(big_run_dir):
    make_target(big_run_dir / "kimi", layers=61, vocab=163840, wrapped=True)
    assert num_hidden_layers(big_run_dir / "kimi") == 61
    cfg = loads(BASE.replace('path = "model"', 'path = "kimi"'))
    assert cfg.extract.layer_ids == (2, 30, 58, 61)
    cfg = loads(BASE)
    assert cfg.extract.layer_ids == (2, 4, 5, 8)


def test_from_dict_does_not_check_paths(big_run_dir):
    cfg = loads(BASE)
    d = json.loads(json.dumps(cfg.to_dict()))
    shutil.rmtree(big_run_dir / "model")
    (big_run_dir / "chat.jsonl").unlink()
    assert RunConfig.from_dict(d) == cfg


def test_selftest_pipeline_needs_neither_target_nor_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = loads("""
name = "st"
pipeline = ["selftest"]
[resources]
ranks = 2
[stages.selftest]
ranks = 3
max_restarts = 4
backoff = 0
options = { fail_at_step = 5, fail_attempts = [1, 2] }
""")
    assert cfg.target is None and cfg.data is None
    assert cfg.extract.layer_ids is None
    assert stage_world_size(cfg, "selftest") == 3
    assert stage_settings(cfg, "selftest") == (4, 0.0, {"fail_at_step": 5, "fail_attempts": [1, 2]})
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("key", ["stall_timeout", "exit_timeout"])
def test_hang_bounds_are_stage_settings_and_must_not_be_negative(tmp_path, monkeypatch, key):
    monkeypatch.chdir(tmp_path)
    text = 'name = "st"\npipeline = ["selftest"]\n[stages.selftest]\n' + key + " = {}\n"
    cfg = loads(text.format(90))
    assert getattr(cfg.stages["selftest"], key) == 90.0 and RunConfig.from_dict(cfg.to_dict()) == cfg
    assert errors(text.format(-1)) == [f"run.toml: stages.selftest.{key}: -1 is out of range; use a number >= 0"]
    assert errors(text.format('"10m"')) == [f"run.toml: stages.selftest.{key}: expected a number, got string '10m'"]
    # Unset, it stays unset (the daemon then applies the stage's default), even beside other keys.
    cfg = loads('name = "st"\npipeline = ["selftest"]\n[stages.selftest]\nmax_restarts = 1\n')
    assert getattr(cfg.stages["selftest"], key) is None
    assert cfg.to_dict()["stages"]["selftest"][key] is None


def test_log_max_mb_bounds_rank_logs_and_must_be_a_number_not_below_0(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = 'name = "st"\npipeline = ["selftest"]\n[stages.selftest]\nlog_max_mb = {}\n'
    for value, got in (("2", 2.0), ("0", 0.0), ("0.5", 0.5)):
        cfg = loads(text.format(value))
        assert cfg.stages["selftest"].log_max_mb == got and RunConfig.from_dict(cfg.to_dict()) == cfg
    assert errors(text.format(-1)) == ["run.toml: stages.selftest.log_max_mb: -1 is out of range; use a number >= 0"]
    assert errors(text.format('"512MB"')) == [
        "run.toml: stages.selftest.log_max_mb: expected a number, got string '512MB'"
    ]
    # Unset, the default bound reaches the ranks' config.json.
    cfg = loads('name = "st"\npipeline = ["selftest"]\n[stages.selftest]\nmax_restarts = 1\n')
    assert cfg.to_dict()["stages"]["selftest"]["log_max_mb"] == 512


def test_misspelled_keys_get_a_suggestion_at_every_level(big_run_dir):
    text = (
        'pipline = ["selftest"]\ncolour = 1\n'
        + BASE.replace('path = "model"', 'path = "model"\ndtyp = "float16"')
        + """
[train]
epoch = 3
[stages.train]
max_restart = 1
"""
    )
    assert errors(text) == [
        "run.toml: pipline: unknown key; did you mean 'pipeline'?",
        "run.toml: colour: unknown key; valid keys: name, output_dir, pipeline, target, data, extract, "
        "resources, draft, train, evaluate, regenerate, storage, slurm, tracking, stages, preflight",
        "run.toml: target.dtyp: unknown key; did you mean 'target.dtype'?",
        "run.toml: train.epoch: unknown key; did you mean 'train.epochs'?",
        "run.toml: stages.train.max_restart: unknown key; did you mean 'stages.train.max_restarts'?",
    ]


def test_missing_and_broken_model_paths(big_run_dir):
    text = BASE.replace('path = "model"', 'path = "nowhere"')
    assert errors(text) == [
        f"run.toml: target.path: {big_run_dir}/nowhere does not exist; point it at a model directory with config.json",
    ]
    (big_run_dir / "empty").mkdir()
    assert errors(BASE.replace('path = "model"', 'path = "empty"')) == [
        f"run.toml: target.path: {big_run_dir}/empty has no config.json; point it at a model directory with config.json",
    ]
    assert errors(BASE.replace('path = "model"', 'path = "chat.jsonl"')) == [
        f"run.toml: target.path: {big_run_dir}/chat.jsonl is not a directory; "
        "point it at a model directory with config.json",
    ]
    (big_run_dir / "model" / "config.json").write_text('{"hidden_size": 8}')
    assert errors(BASE) == [
        f"run.toml: target.path: {big_run_dir}/model/config.json is unusable (config.json has no "
        "num_hidden_layers (nor text_config.num_hidden_layers)); point it at a model directory with config.json",
    ]


def test_missing_required_keys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert errors('[target]\ndtype = "float16"\n') == [
        'run.toml: name: missing; add name = "my-run" at the top of the file',
        "run.toml: target.path: missing; set it to the target model's directory (the one with config.json)",
        "run.toml: data: missing (stage prepare reads the dataset); add a [data] table with "
        'path = "<chat .jsonl file or directory>"',
    ]
    assert errors('name = "x"\npipeline = ["extract", "train"]\n') == [
        "run.toml: target: missing (stages extract, train read the target model); "
        'add a [target] table with path = "<model directory>"',
    ]
    assert errors('name = "x"\n[data]\npath = "missing.jsonl"\n') == [
        "run.toml: target: missing (stages prepare, extract, vocab, train, evaluate read the target model); "
        'add a [target] table with path = "<model directory>"',
        f"run.toml: data.path: {tmp_path}/missing.jsonl does not exist; point it at a .jsonl file or a directory",
    ]


def test_wrong_types(big_run_dir):
    text = (
        BASE
        + """
[train]
lr = "1e-4x"
epochs = 1.5
seed = true
[extract]
layer_ids = "2,4"
[resources]
devices = 0
"""
    )
    text = text.replace('path = "model"', 'path = "model"\ntrust_remote_code = "yes"')
    assert errors(text) == [
        "run.toml: target.trust_remote_code: expected true or false, got string 'yes'",
        "run.toml: extract.layer_ids: expected an array of layer ids, got string '2,4'",
        'run.toml: resources.devices: expected "auto", "cpu" or a list of GPU indices, got integer 0',
        "run.toml: train.epochs: expected an integer, got float 1.5",
        "run.toml: train.lr: expected a number, got string '1e-4x'",
        "run.toml: train.seed: expected an integer, got boolean true",
    ]
    assert errors('name = 3\npipeline = ["selftest"]\n[draft]\n') == [
        "run.toml: name: expected a string, got integer 3",
    ]
    assert errors('name = "x"\npipeline = ["selftest"]\ndraft = 3\n') == [
        "run.toml: draft: expected a table, got integer 3; write it as [draft]",
    ]


def test_out_of_range_values(big_run_dir):
    text = (
        BASE.replace('path = "chat.jsonl"', 'path = "chat.jsonl"\nmax_length = 8\nvalidation_fraction = 1.0')
        + """
[draft]
num_layers = 9
[train]
lr = 1.0
grad_clip = 0
[resources]
ranks = 0
[stages.train]
max_restarts = 101
"""
    )
    assert errors(text) == [
        "run.toml: data.max_length: 8 is out of range 16..1048576; use an integer from 16 to 1048576",
        "run.toml: data.validation_fraction: 1.0 is out of range; use a number >= 0 and < 1",
        "run.toml: resources.ranks: 0 is out of range 1..1024; use an integer from 1 to 1024",
        "run.toml: draft.num_layers: 9 is out of range 1..8; use an integer from 1 to 8",
        "run.toml: train.lr: 1.0 is out of range; use a number > 0 and < 1",
        "run.toml: train.grad_clip: 0 is out of range; use a number > 0",
        "run.toml: stages.train.max_restarts: 101 is out of range 0..100; use an integer from 0 to 100",
    ]
    assert errors(BASE + "[draft]\nvocab_size = 60000\n") == [
        "run.toml: draft.vocab_size: 60000 exceeds the target's vocabulary (50000); use at most 50000",
    ]
    assert errors('name = "has space"\npipeline = ["selftest"]\n') == [
        "run.toml: name: 'has space' may only hold letters, digits, '.', '_' and '-'; e.g. 'has-space'",
    ]
    assert errors(f'name = "{"x" * 81}"\npipeline = ["selftest"]\n') == [
        "run.toml: name: 81 characters is too long; use at most 80",
    ]


def test_bad_enums_list_the_choices(big_run_dir):
    text = (
        BASE.replace('path = "model"', 'path = "model"\ndtype = "fp16"')
        + """
[extract]
backend = "sglang"
[train]
strategy = "fsdp2"
"""
    )
    assert errors(text) == [
        "run.toml: target.dtype: unknown value 'fp16'; use one of: float32, float16, bfloat16",
        "run.toml: extract.backend: unknown value 'sglang'; use one of: hf, vllm",
        "run.toml: train.strategy: unknown value 'fsdp2'; did you mean 'fsdp'? (one of: ddp, fsdp)",
    ]
    assert errors(BASE + '[resources]\ndevices = "gpu"\n') == [
        'run.toml: resources.devices: unknown value \'gpu\'; use "auto", "cpu" or a list of GPU indices like [0, 1]',
    ]


@pytest.mark.parametrize(
    "ids, expected",
    [
        ("[2, 4, 4, 8]", "4 is listed twice; list each id once, e.g. [2, 4, 8]"),
        ("[2, 5, 4, 8]", "[2, 5, 4, 8] is not in ascending order; write [2, 4, 5, 8]"),
        (
            "[2, 4, 9]",
            "9 is out of range 0..8 for a 8-layer target; use ids from 0 to 8 (8 is the final pre-norm output)",
        ),
        ("[8]", "1 id given; list at least 2 (EAGLE-3 fuses several layers), e.g. [2, N//2, N-3, N]"),
        ("[2, 4.0]", "expected integers, got float 4.0"),
    ],
)
def test_bad_layer_ids(big_run_dir, ids, expected):
    assert errors(BASE + f"[extract]\nlayer_ids = {ids}\n") == [f"run.toml: extract.layer_ids: {expected}"]


def test_layer_ids_out_of_range_for_a_61_layer_target(big_run_dir):
    make_target(big_run_dir / "kimi", layers=61, vocab=163840, wrapped=True)
    text = BASE.replace('path = "model"', 'path = "kimi"') + "[extract]\nlayer_ids = [2, 30, 58, 70]\n"
    assert errors(text) == [
        "run.toml: extract.layer_ids: 70 is out of range 0..61 for a 61-layer target; "
        "use ids from 0 to 61 (61 is the final pre-norm output)",
    ]


def test_pipeline_and_stage_mistakes(big_run_dir):
    text = (
        BASE.replace('name = "t"', 'name = "t"\npipeline = ["prepare", "extrct", "train", "train", 3]')
        + """
[stages.evaluate]
max_restarts = 1
[stages.tran]
max_restarts = 1
[stages.prepare]
ranks = 2
[stages.train]
options = 3
"""
    )
    assert errors(text) == [
        "run.toml: pipeline: unknown stage 'extrct'; did you mean 'extract'?",
        "run.toml: pipeline: 'train' is listed twice; list each stage once",
        "run.toml: pipeline: expected stage names, got integer 3",
        "run.toml: stages.evaluate: 'evaluate' is not in the pipeline; add it to pipeline or remove [stages.evaluate]",
        "run.toml: stages.tran: unknown stage; did you mean 'stages.train'?",
        "run.toml: stages.prepare.ranks: prepare always runs as one rank; remove this key",
        "run.toml: stages.train.options: expected a table, got integer 3; write it as { key = value, ... }",
    ]
    assert errors('name = "x"\npipeline = []\n') == [
        'run.toml: pipeline: empty; list at least one stage, e.g. ["prepare", "extract", "vocab", "train", "evaluate"]',
    ]
    assert errors('name = "x"\npipeline = ["nonsense"]\n') == [
        "run.toml: pipeline: unknown stage 'nonsense'; choose from preflight, prepare, regenerate, extract, vocab, "
        "train, evaluate, selftest",
    ]


def test_tensor_parallel_needs_vllm_and_enough_devices(big_run_dir):
    assert errors(BASE + "[extract]\ntensor_parallel_size = 2\n") == [
        'run.toml: extract.tensor_parallel_size: 2 needs backend "vllm"; '
        'set extract.backend = "vllm" or tensor_parallel_size = 1',
    ]
    text = BASE + '[extract]\nbackend = "vllm"\ntensor_parallel_size = 4\n[resources]\ndevices = [0, 1]\n'
    assert errors(text) == [
        "run.toml: extract.tensor_parallel_size: 4 needs 4 GPUs but resources.devices lists 2; "
        "list 4 devices or lower tensor_parallel_size",
    ]
    # A rejected backend is reported once, not again as a tensor-parallel conflict.
    assert errors(BASE + '[extract]\nbackend = "x"\ntensor_parallel_size = 2\n') == [
        "run.toml: extract.backend: unknown value 'x'; use one of: hf, vllm",
    ]


def test_bad_devices(big_run_dir):
    assert errors(BASE + '[resources]\ndevices = [0, 0, -1, "a"]\n') == [
        "run.toml: resources.devices: 0 is listed twice; list each GPU once",
        "run.toml: resources.devices: -1 is not a GPU index; use non-negative integers like [0, 1]",
        "run.toml: resources.devices: expected GPU indices (integers), got string 'a'",
    ]


def test_toml_syntax_errors_are_one_line_with_the_line_number(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert errors('name = "x"\n[target\npath = "m"\n') == [
        "run.toml: line 2, column 8: TOML syntax error: Expected ']' at the end of a table declaration; "
        "fix the syntax there (see https://toml.io)",
    ]
    assert errors('name = "x"\n\nlayer_ids = [1,\n') == [
        "run.toml: line 3 (end of file): TOML syntax error: Invalid value; fix the syntax there (see https://toml.io)",
    ]
    with pytest.raises(ConfigError) as exc:
        load("absent.toml")
    assert exc.value.errors == ["absent.toml: cannot read the file (No such file or directory); check the path"]


def test_options_must_survive_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert errors('name = "x"\npipeline = ["selftest"]\n[stages.selftest]\noptions = { at = 1979-05-27 }\n') == [
        "run.toml: stages.selftest.options: holds a date or time, which cannot be passed to a stage; "
        "quote it as a string",
    ]


def test_several_mistakes_are_reported_together(big_run_dir):
    text = """
name = "two words"
[target]
pth = "model"
[data]
path = "chat.jsonl"
limit = -1
[train]
lr = "fast"
"""
    assert errors(text) == [
        "run.toml: name: 'two words' may only hold letters, digits, '.', '_' and '-'; e.g. 'two-words'",
        "run.toml: target.pth: unknown key; did you mean 'target.path'?",
        "run.toml: target.path: missing; set it to the target model's directory (the one with config.json)",
        "run.toml: data.limit: -1 is out of range; use an integer >= 0",
        "run.toml: train.lr: expected a number, got string 'fast'",
    ]


def point_example(name: str, replacements: dict[str, str], dest: Path) -> Path:
    text = (EXAMPLES / name).read_text()
    for old, new in replacements.items():
        assert f'"{old}"' in text
        text = text.replace(f'"{old}"', json.dumps(new))
    dest.write_text(text)
    return dest


def test_kimi_example_is_valid_against_a_fake_target(tmp_path):
    make_target(tmp_path / "Kimi-K2.5", layers=61, vocab=163840, wrapped=True)
    (tmp_path / "chat.jsonl").write_text("")
    path = point_example(
        "kimi-k2.5-8gpu.toml",
        {"/models/Kimi-K2.5": str(tmp_path / "Kimi-K2.5"), "/data/kimi-chat.jsonl": str(tmp_path / "chat.jsonl")},
        tmp_path / "kimi.toml",
    )
    cfg = load(path)
    assert cfg.target == TargetConfig(path=str(tmp_path / "Kimi-K2.5"), dtype="bfloat16", trust_remote_code=True)
    assert cfg.extract == ExtractConfig(
        backend="vllm", layer_ids=(2, 30, 58, 61), tensor_parallel_size=8, batch_size=16
    )
    assert cfg.resources == ResourcesConfig(ranks=8, devices=(0, 1, 2, 3, 4, 5, 6, 7))
    assert cfg.draft.vocab_size == 32000
    assert [stage_world_size(cfg, s) for s in cfg.pipeline] == [1, 1, 1, 1, 8, 1]


def test_eyas_validate_reports_every_mistake_and_exits_2(tmp_path):
    (tmp_path / "bad.toml").write_text(
        'name = "x"\npipeline = ["selftest"]\n[resources]\nrank = 2\n[train]\nlr = "1e-4x"\n'
    )
    proc = subprocess.run([EYAS, "validate", "bad.toml"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "bad.toml: resources.rank: unknown key; did you mean 'resources.ranks'?",
        "bad.toml: train.lr: expected a number, got string '1e-4x'",
    ]


def test_eyas_validate_accepts_the_demo_example(tmp_path):
    make_target(tmp_path / "tiny", layers=4, vocab=512)
    # The demo's target has its weights (eyas validate refuses a target without any, state/preload.py).
    (tmp_path / "tiny" / "model.safetensors").touch()
    (tmp_path / "chat.jsonl").write_text("")
    point_example(
        "demo.toml",
        {"assets/tiny-deepseek": str(tmp_path / "tiny"), "assets/chat.jsonl": str(tmp_path / "chat.jsonl")},
        tmp_path / "demo.toml",
    )
    proc = subprocess.run([EYAS, "validate", "demo.toml"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.splitlines() == [
        "demo.toml: valid",
        "  name       demo",
        "  pipeline   preflight -> prepare -> regenerate -> extract -> vocab -> train -> evaluate",
        f"  target     {tmp_path}/tiny (4 layers, float32)",
        f"  data       {tmp_path}/chat.jsonl (auto, max_length 256)",
        "  extract    hf, tensor parallel 1, batch 4",
        "  layer ids  1 (entering layer 1), 2 (entering layer 2), 4 (final pre-norm output)",
        "  evaluate   vLLM, 3 draft tokens, tensor parallel 1, all prompts from regenerate's validation rows, "
        "64 tokens each",
        "  ranks      preflight 1, prepare 1, regenerate 2, extract 2, vocab 1, train 2, evaluate 1",
        "  devices    cpu",
        "  output     chosen by the daemon (<state>/runs/<id>/out)",
    ]


def test_the_demo_example_points_at_assets_beside_it():
    """Unpointed, the demo config names the assets the demo builds next to it."""
    with pytest.raises(ConfigError) as exc:
        load(EXAMPLES / "demo.toml")
    src = str(EXAMPLES / "demo.toml")
    assert exc.value.errors == [
        f"{src}: target.path: {EXAMPLES}/assets/tiny-deepseek does not exist; "
        "point it at a model directory with config.json",
        f"{src}: data.path: {EXAMPLES}/assets/chat.jsonl does not exist; point it at a .jsonl file or a directory",
    ]


def test_config_check_imports_no_ml_stack():
    code = (
        "import sys, eyas.cli.configcheck, eyas.state.runconfig; "
        "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'textual') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_default_draft_vocab_is_checked_only_when_a_draft_is_built(tmp_path):
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "vocab_size": 512}'
    )
    base = f'name = "x"\n[target]\npath = "{target}"\n'
    cfg = tmp_path / "extract.toml"
    cfg.write_text('pipeline = ["extract"]\n' + base)
    assert config.load(cfg).draft.vocab_size == 32000  # unused by extract alone
    cfg.write_text('pipeline = ["extract", "vocab"]\n' + base)
    with pytest.raises(config.ConfigError) as err:
        config.load(cfg)
    assert err.value.errors == [
        f"{cfg}: draft.vocab_size: 32000 exceeds the target's vocabulary (512); use at most 512"
    ]


def test_stage_options_are_checked_with_the_config(big_run_dir):
    """A stage's options fail `load` (so `eyas validate` and `eyas submit`), not the stage hours into a run."""
    text = (
        BASE
        + """
[stages.train]
options = { scheduler = "cosin", save_evry = 10, log_every = 0, ttt_step_loss_decay = "1" }
[stages.evaluate]
options = { vllm = { dtype = "half", max_num_seqs = 4 }, vlm = {} }
[stages.extract]
options = { vllm = 3, worker_extension = "nodots" }
[stages.prepare]
options = { x = 1 }
"""
    )
    assert errors(text) == [
        "run.toml: stages.train.options.save_evry: unknown key; did you mean 'stages.train.options.save_every'?",
        "run.toml: stages.train.options.scheduler: unknown value 'cosin'; did you mean 'cosine'? "
        "(one of: linear, cosine, constant)",
        "run.toml: stages.train.options.log_every: 0 is out of range; use an integer >= 1",
        "run.toml: stages.train.options.ttt_step_loss_decay: expected a number, got string '1'",
        "run.toml: stages.evaluate.options.vlm: unknown key; did you mean 'stages.evaluate.options.vllm'?",
        "run.toml: stages.evaluate.options.vllm: sets dtype, which eyas sets itself; remove it "
        "(tensor_parallel_size: evaluate.tensor_parallel_size; dtype: target.dtype; "
        "speculative_config: evaluate.num_speculative_tokens)",
        "run.toml: stages.extract.options.vllm: expected a table, got integer 3; write it as { key = value, ... }",
        "run.toml: stages.extract.options.worker_extension: 'nodots' is not a class name; "
        'name it as "package.module.Class"',
        "run.toml: stages.prepare.options.x: unknown key; prepare takes no options, so remove it",
    ]
    assert errors(
        BASE + '[stages.extract]\noptions = { vllm = { max_num_batched_tokens = 2048 }, worker_extention = "a.B" }\n'
    ) == [
        "run.toml: stages.extract.options.worker_extention: unknown key; did you mean 'stages.extract.options.worker_extension'?",
    ]


def test_valid_stage_options_are_kept_as_written_and_read_with_their_defaults(big_run_dir):
    cfg = loads(
        BASE
        + """
[stages.train]
options = { scheduler = "cosine", save_every = 100, attention = "sdpa", ttt_step_loss_decay = 1 }
[stages.evaluate]
options = { vllm = { gpu_memory_utilization = 0.8 } }
[stages.extract]
options = { vllm = { max_num_batched_tokens = 2048 }, worker_extension = "my_ext.MyExtension" }
"""
    )
    train = stage_settings(cfg, "train")[2]
    assert train == {"scheduler": "cosine", "save_every": 100, "attention": "sdpa", "ttt_step_loss_decay": 1}
    opts = stage_options("train", train)
    assert (opts.scheduler, opts.save_every, opts.log_every, opts.ttt_step_loss_decay) == ("cosine", 100, 1, 1.0)
    assert stage_options("evaluate", stage_settings(cfg, "evaluate")[2]).vllm == {"gpu_memory_utilization": 0.8}
    ext = stage_options("extract", stage_settings(cfg, "extract")[2])
    assert (ext.vllm, ext.worker_extension) == ({"max_num_batched_tokens": 2048}, "my_ext.MyExtension")
    assert stage_options("evaluate", {}).vllm == {} and stage_options("extract", {}).vllm is None
    assert RunConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_eyas_validate_refuses_a_misspelt_stage_option(big_run_dir):
    (big_run_dir / "run.toml").write_text(BASE + '[stages.train]\noptions = { scheduler = "cosin" }\n')
    proc = subprocess.run([EYAS, "validate", "run.toml"], cwd=big_run_dir, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [
        "run.toml: stages.train.options.scheduler: unknown value 'cosin'; did you mean 'cosine'? "
        "(one of: linear, cosine, constant)",
    ]


def test_streaming_on_the_vllm_backend_takes_one_driver_rank(big_run_dir):
    text = BASE + '[extract]\nbackend = "vllm"\n[storage]\nmode = "streaming"\n[resources]\nranks = 2\n'
    (line,) = [e for e in errors(text) if "storage.mode" in e]
    assert line.endswith(
        'storage.mode: "streaming" with extract.backend = "vllm" runs one driver rank, and extract would start 2: '
        "set [stages.extract] ranks = 1 (its engine takes extract.tensor_parallel_size GPUs)"
    )
    cfg = loads(text + "[stages.extract]\nranks = 1\n")
    assert (cfg.storage.mode, cfg.extract.backend, cfg.stages["extract"].ranks) == ("streaming", "vllm", 1)
