"""The evaluate stage's error bars and quality gate, in pure Python: the bootstrap over prompts
(workers/evaluate/bootstrap.py), each request's counts from vLLM's per-request metrics
(workers/evaluate/engines.py: prompt_counts), one prompt per assistant turn
(workers/evaluate/prompts.py: turn_starts), and the gate's verdict in words
(workers/stages/evaluate.py: gate)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from eyas.workers.evaluate import bootstrap
from eyas.workers.evaluate.engines import prompt_counts
from eyas.workers.evaluate.prompts import turn_starts
from eyas.workers.stages import evaluate

K = 3


def counts(steps: list[int]) -> dict:
    """One prompt's counts from the draft tokens accepted at each verify step (k = 3)."""
    return {
        "drafts": len(steps),
        "draft_tokens": K * len(steps),
        "accepted": sum(steps),
        "accepted_per_pos": [sum(1 for a in steps if a > i) for i in range(K)],
    }


def prompts(n: int, seed: int = 1) -> list[dict]:
    """n prompts of unequal difficulty and length, as a trained draft meets them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.random()  # this prompt's chance that each next draft token is accepted
        steps = []
        for _ in range(rng.randint(1, 30)):
            a = 0
            while a < K and rng.random() < p:
                a += 1
            steps.append(a)
        out.append(counts(steps))
    return out


def point(per_prompt: list[dict]) -> float:
    total = bootstrap.sum_counts(per_prompt, K)
    return 1 + total["accepted"] / total["drafts"]


def test_quantiles_interpolate_as_numpy_does():
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert bootstrap.quantile(values, 0.0) == 1.0
    assert bootstrap.quantile(values, 1.0) == 10.0
    assert bootstrap.quantile(values, 0.5) == 3.0
    assert bootstrap.quantile(values, 0.9) == pytest.approx(7.6)  # numpy.quantile(values, 0.9)
    assert bootstrap.interval(list(range(101)), 0.95) == pytest.approx([2.5, 97.5])
    with pytest.raises(ValueError):
        bootstrap.quantile([], 0.5)


def test_the_interval_brackets_the_point_figure_and_is_the_same_every_time():
    trained, untrained = prompts(60), [counts([0] * 10) for _ in range(60)]
    a = bootstrap.bootstrap({"trained": trained, "baseline": untrained}, K, paired=("trained", "baseline"))
    b = bootstrap.bootstrap({"trained": trained, "baseline": untrained}, K, paired=("trained", "baseline"))
    assert a == b  # a fixed seed: the same draws, the same interval
    lo, hi = a["trained"]["acceptance_length"]
    assert lo < point(trained) < hi
    rates = [
        n / bootstrap.sum_counts(trained, K)["drafts"] for n in bootstrap.sum_counts(trained, K)["accepted_per_pos"]
    ]
    for (plo, phi), r in zip(a["trained"]["per_position"], rates):
        assert plo <= r <= phi
    # An untrained draft that never lands a token: no spread at all.
    assert a["baseline"]["acceptance_length"] == [1.0, 1.0]
    # The gain is paired: here trained - 1 on every draw, so its interval is the trained one's, less 1.
    assert a["gain"] == pytest.approx([lo - 1, hi - 1])
    assert (a["units"], a["resamples"], a["seed"], a["level"], a["skipped"]) == (60, 2000, 0, 0.95, 0)
    # Another seed, other draws: about the same interval, not the same one.
    c = bootstrap.bootstrap({"trained": trained}, K, seed=1)
    assert c["trained"]["acceptance_length"] != a["trained"]["acceptance_length"]
    assert c["trained"]["acceptance_length"] == pytest.approx(a["trained"]["acceptance_length"], abs=0.05)


def test_the_interval_narrows_with_more_prompts():
    def width(n: int) -> float:
        lo, hi = bootstrap.bootstrap({"t": prompts(n, seed=2)}, K)["t"]["acceptance_length"]
        return hi - lo

    w30, w120, w480 = width(30), width(120), width(480)
    # About 1/sqrt(n): half as wide for four times the prompts.
    assert w120 < 0.75 * w30 and w480 < 0.75 * w120
    assert w480 == pytest.approx(w120 / 2, rel=0.35)


def test_equal_prompts_give_no_spread():
    same = [counts([1, 2, 0, 3])] * 20
    out = bootstrap.bootstrap({"t": same}, K)
    assert out["t"]["acceptance_length"] == pytest.approx([point(same)] * 2)


def test_the_paired_gain_is_narrower_than_the_two_intervals_side_by_side():
    """Prompts easy or hard for both drafts: the difference varies far less than either."""
    rng = random.Random(3)
    trained, untrained = [], []
    for _ in range(80):
        hard = rng.random() < 0.5
        trained.append(counts([0] * 8 + [1] * 2 if hard else [2] * 6 + [3] * 4))
        untrained.append(counts([0] * 9 + [1] if hard else [2] * 7 + [1] * 3))
    out = bootstrap.bootstrap({"t": trained, "u": untrained}, K, paired=("t", "u"))
    (lo, hi), (ulo, uhi), (glo, ghi) = out["t"]["acceptance_length"], out["u"]["acceptance_length"], out["gain"]
    assert glo < point(trained) - point(untrained) < ghi
    assert ghi - glo < (hi - lo) / 2 and ghi - glo < (uhi - ulo) / 2


def test_groups_are_resampled_whole():
    """A chat's turns are one unit: as many units as chats, each the sum of its turns."""
    per_prompt = prompts(12)
    groups = [7, 7, 3, 3, 3, 9, 1, 1, 1, 1, 5, 8]
    units = bootstrap.units(per_prompt, groups, K)
    assert len(units) == 6
    assert units[0] == bootstrap.sum_counts(per_prompt[:2], K)
    assert units[1] == bootstrap.sum_counts(per_prompt[2:5], K)
    out = bootstrap.bootstrap({"t": per_prompt}, K, groups)
    assert out["units"] == 6
    lo, hi = out["t"]["acceptance_length"]
    assert lo <= point(per_prompt) <= hi
    with pytest.raises(ValueError, match="3 groups for 12 prompts"):
        bootstrap.units(per_prompt, [1, 2, 3], K)


def test_draws_without_a_draft_are_left_out_and_counted():
    # Two prompts answered in one token (no draft), one with drafts: some draws hold none.
    per_prompt = [counts([]), counts([]), counts([1, 1])]
    out = bootstrap.bootstrap({"t": per_prompt}, K, resamples=200)
    assert 0 < out["skipped"] < 200
    assert out["t"]["acceptance_length"] == [2.0, 2.0]
    nothing = bootstrap.bootstrap({"t": [counts([])] * 3}, K, paired=None, resamples=10)
    assert nothing["skipped"] == 10 and nothing["t"]["acceptance_length"] is None


def test_drafts_measured_on_other_prompts_are_refused():
    with pytest.raises(ValueError, match="different numbers of prompts"):
        bootstrap.bootstrap({"t": prompts(3), "u": prompts(4)}, K)


def test_a_requests_counts_from_vllms_histogram():
    """Histogram index j: steps that accepted j draft tokens (a prefix: positions 0..j-1)."""
    m = SimpleNamespace(histogram=[4, 3, 2, 1], num_draft_tokens=30)
    assert prompt_counts(m, K) == {
        "drafts": 10,
        "draft_tokens": 30,
        "accepted": 3 + 4 + 3,
        "accepted_per_pos": [6, 3, 1],
    }
    assert prompt_counts(None, K) is None


def test_one_prompt_per_assistant_turn():
    #        sys  user  answer   user  answer  user answer
    mask = [0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1]
    assert turn_starts(mask) == [4, 9, 12]
    assert turn_starts([1, 1, 0, 1]) == [3]  # no prompt before an answer that opens the row
    assert turn_starts([0, 0, 0]) == []


def summary(trained: float, untrained: float, lo: float | None, hi: float | None, prompts: int = 30) -> dict:
    how = {"level": 0.95} if lo is not None else {"level": 0.95, "note": "vLLM 0.31.0 counts no drafts per request"}
    return {
        "acceptance_length": trained,
        "baseline_acceptance_length": untrained,
        "gain": trained - untrained,
        "gain_lo": lo,
        "gain_hi": hi,
        "prompts": prompts,
        "interval": how,
    }


def test_the_gate_says_why_in_words():
    assert evaluate.gate(summary(1.004, 1.0, -0.01, 0.012), 0.1) == (
        "the draft learned nothing: acceptance 1.00 against 1.00 untrained on 30 prompts (gain 0.00, "
        "95 % interval -0.01 to 0.01; evaluate.min_gain = 0.1); train it longer or on more data, or lower "
        "evaluate.min_gain (0 turns the gate off)"
    )
    assert evaluate.gate(summary(1.07, 1.0, 0.03, 0.11, prompts=56), 0.1) == (
        "the draft learned too little: acceptance 1.07 against 1.00 untrained on 56 prompts (gain 0.07, "
        "95 % interval 0.03 to 0.11; evaluate.min_gain = 0.1); train it longer or on more data, or lower "
        "evaluate.min_gain (0 turns the gate off)"
    )
    assert evaluate.gate(summary(1.0, 1.0, None, None), 0.25).startswith(
        "the draft learned nothing: acceptance 1.00 against 1.00 untrained on 30 prompts (gain 0.00, no "
        "interval: vLLM 0.31.0 counts no drafts per request; evaluate.min_gain = 0.25)"
    )
    # Passed, or off.
    assert evaluate.gate(summary(1.37, 1.0, 0.25, 0.61), 0.1) is None
    assert evaluate.gate(summary(1.0, 1.0, -0.01, 0.01), 0) is None
    # Its exception is its own type, and final: the daemon restarts no attempt for it.
    assert evaluate.QualityGateFailed.eyas_final is True
    assert not issubclass(evaluate.QualityGateFailed, evaluate.LosslessError)


def test_the_rank_records_a_final_failure_as_final():
    from eyas.workers.runtime.rank import error_record

    gate = error_record(evaluate.QualityGateFailed("the draft learned nothing"), rank=0, stage="evaluate", attempt=1)
    assert (gate["type"], gate["message"], gate["final"]) == (
        "eyas.workers.stages.evaluate.QualityGateFailed",
        "the draft learned nothing",
        True,
    )
    assert "final" not in error_record(RuntimeError("boom"), rank=0, stage="evaluate", attempt=1)
