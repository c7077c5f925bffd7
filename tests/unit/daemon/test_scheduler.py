"""Which GPUs each stage claims: the scheduler's real device logic, with only the GPU count faked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eyas.daemon.core import Core


class _Holder:
    def __init__(self, run_id: int, devices: list[int]):
        self.run_id, self.devices = run_id, devices


def _core(gpus: int, held: dict[int, list[int]] | None = None) -> Core:
    sampler = SimpleNamespace(gpu_available=gpus > 0, gpu=SimpleNamespace(device_count=lambda: gpus))
    core = Core(db=None, home=None, sampler=sampler)
    core.groups = {i: _Holder(run, devs) for i, (run, devs) in enumerate((held or {}).items())}
    return core


CFG = {
    "resources": {"devices": "auto"},
    "extract": {"backend": "vllm", "tensor_parallel_size": 4},
    "evaluate": {"tensor_parallel_size": 2},
}


@pytest.mark.parametrize(
    "stage, world, expected",
    [
        ("preflight", 1, []),
        ("prepare", 1, []),
        ("vocab", 1, []),  # CPU work holds no GPU
        ("extract", 1, [0, 1, 2, 3]),  # one vLLM driver at TP 4
        ("train", 2, [0, 1]),  # one GPU per rank
        ("evaluate", 1, [0, 1]),  # vLLM at evaluate's TP size
    ],
)
def test_each_stage_claims_what_it_runs_on(stage, world, expected):
    assert _core(8)._devices_for(CFG, stage, world) == expected


def test_preflight_claims_the_extractions_gpus_for_its_canary():
    run = {**CFG, "pipeline": ["preflight", "prepare", "extract"]}
    assert _core(8)._devices_for(run, "preflight", 1) == [0, 1, 2, 3]  # the canary's engine at TP 4
    hf = {**run, "extract": {"backend": "hf", "tensor_parallel_size": 1}}
    assert _core(8)._devices_for(hf, "preflight", 1) == [0]
    off = {**run, "extract": {**CFG["extract"], "canary": False}}
    assert _core(8)._devices_for(off, "preflight", 1) == []  # checks only: no GPU held
    assert _core(8, held={7: [0, 1, 2, 3, 4, 5]})._devices_for(run, "preflight", 1) is None  # waits for them
    assert _core(8)._devices_for({**run, "resources": {"devices": "cpu"}}, "preflight", 1) == []


def test_cpu_stages_start_while_another_run_holds_every_gpu():
    core = _core(2, held={7: [0, 1]})
    assert core._devices_for(CFG, "preflight", 1) == []
    assert core._devices_for(CFG, "prepare", 1) == []
    assert core._devices_for(CFG, "train", 1) is None  # waits for a GPU
    assert core._devices_for({**CFG, "resources": {"devices": [1]}}, "vocab", 1) == []


def test_evaluate_defaults_to_extracts_tp_size_and_waits_when_short():
    cfg = {**CFG, "evaluate": {}}
    assert _core(8)._devices_for(cfg, "evaluate", 1) == [0, 1, 2, 3]
    assert _core(8, held={3: [0, 1, 2, 3, 4]})._devices_for(cfg, "evaluate", 1) is None


def test_regenerate_claims_an_engine_per_rank_and_preflight_its_canarys():
    cfg = {**CFG, "pipeline": ["preflight", "prepare", "regenerate", "extract"]}
    assert _core(8)._devices_for(cfg, "regenerate", 2) == list(range(8))  # two engines at extract's TP 4
    own = {**cfg, "regenerate": {"tensor_parallel_size": 2}}
    assert _core(8)._devices_for(own, "regenerate", 1) == [0, 1]
    assert _core(8, held={3: [0, 1, 2, 3, 4, 5, 6]})._devices_for(own, "regenerate", 1) is None  # waits
    hf = {**own, "extract": {"backend": "hf", "tensor_parallel_size": 1}}
    assert _core(8)._devices_for(hf, "preflight", 1) == [0, 1]  # the larger canary: regenerate's at TP 2
    quiet = {**hf, "extract": {**hf["extract"], "canary": False}, "regenerate": {"canary": False}}
    assert _core(8)._devices_for(quiet, "preflight", 1) == []
