"""cli/initplan.py, `eyas init`'s arithmetic: the TP it picks is the smallest that fits, the
backend follows from it, and the doctor's memory check passes what it picks."""

from __future__ import annotations

import math

import pytest

from eyas.cli import initplan
from eyas.state.runconfig import ExtractConfig, RunConfig
from eyas.workers.doctor import resources

GB = 10**9
# Weight sizes across the range init meets: a tiny test target, 8B, 70B and DeepSeek-V3/Kimi
# shaped checkpoints (bytes as their safetensors indexes give them).
WEIGHTS = [2_000_000, 16_060_522_496, 141_107_412_992, 595_000_000_000, 688_586_727_753]
MEMORY = [16 * GB, 24 * GB, 80 * GB, 85_520_809_984, 141 * GB, 150 * GB]
GPUS = [1, 2, 4, 6, 8, 16]


def _is_power_of_two(t: int) -> bool:
    return t > 0 and t & (t - 1) == 0


@pytest.mark.parametrize("gpus", [0, *GPUS, 7])
@pytest.mark.parametrize("heads", [None, 2, 12, 128])
def test_tp_sizes_are_the_powers_of_two_up_to_the_gpus_that_divide_the_heads(gpus, heads):
    expected = [t for t in range(1, gpus + 1) if _is_power_of_two(t) and (heads is None or heads % t == 0)]
    assert initplan.tp_sizes(gpus, heads) == expected


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("memory", MEMORY)
@pytest.mark.parametrize("gpus", GPUS)
def test_the_tp_chosen_is_the_smallest_that_fits(weights, memory, gpus):
    limit = initplan.GPU_MEMORY_UTILIZATION * memory
    candidates = initplan.tp_sizes(gpus)
    fitting = [t for t in candidates if math.ceil(weights / t) + initplan.MARGIN <= limit]
    if not fitting:
        with pytest.raises(initplan.NoFit) as exc:
            initplan.place(weights, gpus, memory)
        assert f"at tp {candidates[-1]}," in str(exc.value)
        return
    plan = initplan.place(weights, gpus, memory)
    assert plan.tp == fitting[0]
    assert math.ceil(weights / plan.tp) + initplan.MARGIN <= limit
    assert all(math.ceil(weights / t) + initplan.MARGIN > limit for t in candidates if t < plan.tp)
    # TP 1 keeps one model per GPU on the transformers backend; a sharded target needs vLLM.
    assert plan.backend == ("hf" if plan.tp == 1 else "vllm")
    assert plan.gpus == gpus
    assert plan.why.startswith(f"tp {plan.tp}: ")


def test_a_shard_exactly_at_the_budget_fits_and_one_byte_more_does_not():
    memory, tp = 80 * GB, 8
    edge = int(initplan.GPU_MEMORY_UTILIZATION * memory - initplan.MARGIN) * tp
    assert initplan.place(edge, 8, memory).tp == tp
    assert initplan.place(edge + tp, 16, memory).tp == 2 * tp
    with pytest.raises(initplan.NoFit):
        initplan.place(edge + tp, 8, memory)


def test_the_reason_shows_the_arithmetic():
    weights, memory = 547 * GB, 80 * GB
    plan = initplan.place(weights, 8, memory)
    per_gpu = math.ceil(weights / plan.tp)
    smaller = plan.tp // 2
    assert plan.why == (
        f"tp {plan.tp}: 547.00 GB of weights ÷ {plan.tp} = {per_gpu / GB:.2f} GB + "
        f"{initplan.MARGIN / GB:.2f} GB margin per GPU, within {0.9 * memory / GB:.2f} GB (0.9 × 80.00 GB); "
        f"tp {smaller} would need {(math.ceil(weights / smaller) + initplan.MARGIN) / GB:.2f} GB per GPU, over that"
    )


def test_heads_that_tp_cannot_divide_are_skipped():
    # 12 heads: TP 8 does not divide them, so a target needing more than TP 4 fits nowhere on 8 GPUs.
    memory = 80 * GB
    weights = 5 * int(initplan.GPU_MEMORY_UTILIZATION * memory - initplan.MARGIN)
    assert initplan.place(weights, 8, memory).tp == 8
    with pytest.raises(initplan.NoFit, match="dividing its 12 attention heads"):
        initplan.place(weights, 8, memory, heads=12)


def test_without_gpus_the_run_is_on_cpu_with_the_hf_backend():
    plan = initplan.place(None, 0, None)
    assert (plan.backend, plan.tp, plan.gpus) == ("hf", 1, 0)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("memory", MEMORY)
@pytest.mark.parametrize("gpus", [1, 8])
def test_what_init_picks_passes_the_doctors_memory_check_on_idle_gpus(weights, memory, gpus):
    try:
        plan = initplan.place(weights, gpus, memory)
    except initplan.NoFit:
        return
    cfg = RunConfig(name="t", extract=ExtractConfig(backend=plan.backend, tensor_parallel_size=plan.tp))
    idle = [{"index": i, "name": "GPU", "mem_total": memory, "mem_used": 0} for i in range(gpus)]
    check = resources.memory(cfg, weights, idle)
    assert check.verdict == "pass", check.detail


@pytest.mark.parametrize("vocab", [None, 512, 32000, 32001, 163840])
def test_the_draft_vocabulary_is_capped_at_the_targets(vocab):
    expected = initplan.DRAFT_VOCAB if vocab is None else min(initplan.DRAFT_VOCAB, vocab)
    assert initplan.draft_vocab(vocab) == expected


@pytest.mark.parametrize(("tokens", "ranks"), [(116_250, 8), (10_000_000, 1), (10_000_000, 8), (1, 1)])
def test_the_schedule_counts_the_steps_and_warms_up_for_a_fraction_of_them(tokens, ranks):
    epochs, batch_tokens, held_out = 3, 8192, 0.05
    s = initplan.schedule(tokens, epochs, batch_tokens, ranks, held_out)
    per_epoch = max(1, math.ceil(int(tokens * (1 - held_out)) / (batch_tokens * ranks)))
    assert (s.steps_per_epoch, s.total_steps) == (per_epoch, per_epoch * epochs)
    assert s.warmup_steps == round(initplan.WARMUP_FRACTION * s.total_steps)
    assert 0 <= s.warmup_steps < s.total_steps
