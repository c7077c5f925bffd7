"""cli/initplan.py, `eyas init`'s arithmetic: the TP it picks is the smallest the doctor's memory
check passes, the backend follows from it, and init refuses exactly when the doctor fails every
TP the GPUs allow."""

from __future__ import annotations

import math

import pytest
from doctor_models import MODELS

from eyas.cli import init, initplan
from eyas.state.drafttables import ExtractConfig
from eyas.state.inputtables import DataConfig, TargetConfig
from eyas.state.runconfig import RunConfig
from eyas.workers.doctor import memory as doctor_memory

GB = 10**9
# Weight sizes across the range init meets: a tiny test target, 8B, 70B and DeepSeek-V3/Kimi
# shaped checkpoints (bytes as their safetensors indexes give them).
WEIGHTS = [2_000_000, 16_060_522_496, 141_107_412_992, 547 * GB, 595_000_000_000, 688_586_727_753]
MEMORY = [16 * GB, 24 * GB, 80 * GB, 85_520_809_984, 141 * GB, 150 * GB]
GPUS = [1, 2, 4, 6, 8, 16]
# The shapes the doctor sizes activations and the KV cache from: Llama (GQA), Kimi-K2.5 (MLA,
# routed experts, in a text_config), and none (config.json without the keys: the 2 GiB floor).
SHAPES = {"llama": MODELS["llama"][0], "kimi": MODELS["kimi"][0], "unknown": None}


def _is_power_of_two(t: int) -> bool:
    return t > 0 and t & (t - 1) == 0


def _fit(need: int, room: int = 100) -> initplan.Fit:
    return initplan.Fit(need, room, f"need {need}", f"room {room}")


def _judge(needs: dict[int, int], room: int = 100) -> initplan.Judge:
    return lambda tp: _fit(needs[tp], room)


@pytest.mark.parametrize("gpus", [0, *GPUS, 7])
@pytest.mark.parametrize("heads", [None, 2, 12, 128])
def test_tp_sizes_are_the_powers_of_two_up_to_the_gpus_that_divide_the_heads(gpus, heads):
    expected = [t for t in range(1, gpus + 1) if _is_power_of_two(t) and (heads is None or heads % t == 0)]
    assert initplan.tp_sizes(gpus, heads) == expected


@pytest.mark.parametrize("gpus", GPUS)
@pytest.mark.parametrize("needs", [(50, 50, 50, 50, 50), (150, 90, 60, 40, 30), (500, 400, 300, 200, 101)])
def test_the_tp_chosen_is_the_smallest_the_judge_passes(gpus, needs):
    judged = dict(zip((1, 2, 4, 8, 16), needs))
    candidates = initplan.tp_sizes(gpus)
    fitting = [t for t in candidates if judged[t] <= 100]
    if not fitting:
        with pytest.raises(initplan.NoFit) as exc:
            initplan.place(gpus, _judge(judged))
        assert (
            f"at tp {candidates[-1]}, the largest power of two up to {gpus}, need {judged[candidates[-1]]}, over room 100"
            in str(exc.value)
        )
        return
    plan = initplan.place(gpus, _judge(judged))
    assert plan.tp == fitting[0]
    # TP 1 keeps one model per GPU on the transformers backend; a sharded target needs vLLM.
    assert plan.backend == ("hf" if plan.tp == 1 else "vllm")
    assert plan.gpus == gpus
    assert plan.why.startswith(f"tp {plan.tp}: need {judged[plan.tp]}, within room 100")


def test_a_need_exactly_at_the_room_fits_and_one_byte_more_does_not():
    assert initplan.place(8, _judge({1: 101, 2: 101, 4: 101, 8: 100})).tp == 8
    assert initplan.place(16, _judge({1: 101, 2: 101, 4: 101, 8: 101, 16: 100})).tp == 16
    with pytest.raises(initplan.NoFit):
        initplan.place(8, _judge({1: 101, 2: 101, 4: 101, 8: 101}))


def test_the_reason_names_the_smaller_tp_and_its_need():
    plan = initplan.place(8, _judge({1: 400, 2: 300, 4: 150, 8: 90}), 80 * GB)
    assert plan.why == "tp 8: need 90, within room 100; tp 4 would need 150 B per GPU, over room 100"


def test_the_refusal_names_the_gpus_and_the_largest_tps_arithmetic():
    with pytest.raises(initplan.NoFit) as exc:
        initplan.place(8, _judge({1: 400, 2: 300, 4: 150, 8: 101}), 80 * GB)
    assert str(exc.value) == (
        "the target does not fit 8 GPUs of 80.00 GB: at tp 8, the largest power of two up to 8, need 101, over room 100"
    )


def test_heads_that_tp_cannot_divide_are_skipped():
    # 12 heads: TP 8 does not divide them, so a target needing TP 8 fits nowhere on 8 GPUs.
    judged = {1: 400, 2: 300, 4: 150, 8: 90}
    assert initplan.place(8, _judge(judged)).tp == 8
    with pytest.raises(initplan.NoFit, match="dividing its 12 attention heads"):
        initplan.place(8, _judge(judged), heads=12)


def test_without_gpus_the_run_is_on_cpu_with_the_hf_backend():
    plan = initplan.place(0, None)
    assert (plan.backend, plan.tp, plan.gpus) == ("hf", 1, 0)


# --- the contract with `eyas doctor`: init's judge is the doctor's memory check ----------------


def _config(backend: str, tp: int) -> RunConfig:
    """The run config init writes, as far as the memory check reads it."""
    return RunConfig(
        name="t",
        target=TargetConfig(path="/target"),
        data=DataConfig(path="/data.jsonl"),
        extract=ExtractConfig(backend=backend, tensor_parallel_size=tp),
    )


def _doctor_passes(model, weights: int, memory: int, gpus: int, tp: int) -> bool:
    idle = [{"index": i, "name": "GPU", "mem_total": memory, "mem_used": 0} for i in range(gpus)]
    check = doctor_memory.memory(_config("hf" if tp == 1 else "vllm", tp), weights, idle, model=model)
    return check.verdict == "pass"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("memory", MEMORY)
@pytest.mark.parametrize("gpus", [1, 8])
def test_init_picks_the_smallest_tp_the_doctor_passes_and_refuses_when_it_passes_none(shape, weights, memory, gpus):
    model = SHAPES[shape]
    judge = init.memory_judge(model, weights, memory, "GPU")
    candidates = initplan.tp_sizes(gpus)
    passing = [t for t in candidates if _doctor_passes(model, weights, memory, gpus, t)]
    # The judge's verdict is the doctor's, TP by TP.
    assert [t for t in candidates if judge(t).fits] == passing
    if not passing:
        with pytest.raises(initplan.NoFit):
            initplan.place(gpus, judge, memory)
        return
    plan = initplan.place(gpus, judge, memory)
    assert plan.tp == passing[0]
    assert plan.backend == ("hf" if plan.tp == 1 else "vllm")


@pytest.mark.parametrize("shape", ["llama", "kimi"])
def test_at_the_doctors_edge_init_and_the_doctor_agree_to_the_byte(shape):
    """Weights whose TP 8 need is exactly vLLM's budget on 80 GB: TP 8, and the doctor passes it;
    8 bytes more (one more per GPU) and both refuse."""
    model, memory, tp = SHAPES[shape], 80 * GB, 8
    probe = init.memory_judge(model, 8 * 60 * GB, memory)(tp)
    edge = 8 * 60 * GB + (probe.room - probe.need) * tp
    at = init.memory_judge(model, edge, memory)(tp)
    assert at.need == at.room
    assert initplan.place(8, init.memory_judge(model, edge, memory), memory).tp == tp
    assert _doctor_passes(model, edge, memory, 8, tp)
    with pytest.raises(initplan.NoFit):
        initplan.place(8, init.memory_judge(model, edge + tp, memory), memory)
    assert not _doctor_passes(model, edge + tp, memory, 8, tp)


def test_the_reason_shows_the_doctors_arithmetic():
    """547 GB of a Kimi-shaped target on 8 H200-sized GPUs: the sentence init writes beside
    tensor_parallel_size is the doctor's own arithmetic for that config."""
    weights, memory, model = 547 * GB, 150 * GB, SHAPES["kimi"]
    plan = initplan.place(8, init.memory_judge(model, weights, memory), memory)
    assert plan.tp == 8
    idle = [{"index": i, "name": "", "mem_total": memory, "mem_used": 0} for i in range(8)]
    check = doctor_memory.memory(_config("vllm", 8), weights, idle, model=model)
    arithmetic = check.detail.partition(";")[0]  # "weights ... = N GB"
    assert arithmetic.startswith(f"weights {math.ceil(weights / 8) / GB:.2f} GB/GPU (547.00 GB ÷ TP 8) + activations ")
    util = check.data["gpu_memory_utilization"]
    assert plan.why.startswith(
        f"tp 8: {arithmetic}, within what vLLM may use, {util:.2f} × 150.00 GB = "
        f"{int(util * memory) / GB:.2f} GB ({check.data['utilization_from']}); tp 4 would need "
    )


@pytest.mark.parametrize("vocab", [None, 512, 32000, 32001, 163840])
def test_the_draft_vocabulary_is_capped_at_the_targets(vocab):
    expected = initplan.DRAFT_VOCAB if vocab is None else min(initplan.DRAFT_VOCAB, vocab)
    assert initplan.draft_vocab(vocab) == expected
