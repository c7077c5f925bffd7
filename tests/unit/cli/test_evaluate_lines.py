"""The evaluate stage's figures as `eyas show` and `eyas submit --follow` print them: with the
bootstrap's intervals, the gain and the gate's verdict; a summary from before the intervals
prints as it always did."""

from __future__ import annotations

from eyas.cli.follow import result
from eyas.cli.history import evaluate_lines

OLD = {
    "num_speculative_tokens": 3,
    "prompts": 30,
    "prompt_source": "validation split",
    "max_tokens": 64,
    "vllm_version": "0.32.0",
    "device": "cpu",
    "tensor_parallel_size": 1,
    "acceptance_length": 1.5227,
    "acceptance_rate": 0.1742,
    "per_position": [0.3, 0.1409, 0.0818],
    "baseline_acceptance_length": 1.0033,
    "baseline_acceptance_rate": 0.0011,
    "baseline_per_position": [0.0033, 0.0, 0.0],
    "draft_tok_s": 345.2,
    "baseline_tok_s": 314.6,
    "target_tok_s": 473.1,
    "speedup": 0.73,
    "lossless": True,
    "mismatched_prompts": 0,
}
NEW = dict(
    OLD,
    prompts=56,
    chats=30,
    answer_tokens=723,
    acceptance_length=1.3712,
    acceptance_length_lo=1.2517,
    acceptance_length_hi=1.6171,
    baseline_acceptance_length=1.0045,
    baseline_acceptance_length_lo=1.0,
    baseline_acceptance_length_hi=1.0102,
    per_position=[0.2083, 0.1042, 0.0587],
    gain=0.3667,
    gain_lo=0.2499,
    gain_hi=0.6126,
    interval={"level": 0.95, "resamples": 2000, "seed": 0, "unit": "chat", "units": 30, "skipped": 0},
    min_gain=0.1,
    gate="passed",
)


def _run(summary: dict) -> dict:
    return {"stages": [{"name": "evaluate", "summary": summary}]}


def test_show_prints_the_intervals_the_gain_and_the_gate():
    assert evaluate_lines(_run(NEW))[1:] == [
        "evaluate (k=3, 56 prompts from the validation split, up to 64 tokens, vLLM 0.32.0 on cpu, tensor parallel 1):",
        "  draft      accept len  95 % interval   accept rate  per position    tok/s",
        "  ---------  ----------  --------------  -----------  --------------  -----",
        "  trained         1.371  [1.252, 1.617]        17.4%  0.21/0.10/0.06    345",
        "  untrained       1.004  [1.000, 1.010]         0.1%  0.00/0.00/0.00    315",
        "  no draft                                                              473",
        "  gain 0.367 [0.250, 0.613] over the untrained draft (95 % paired bootstrap over 30 chats, 723 answer "
        "tokens); quality gate passed (evaluate.min_gain = 0.1)",
        "  speedup x0.73; lossless: yes (greedy outputs with each draft vs without)",
    ]
    failed = evaluate_lines(_run(dict(NEW, gate="failed")))
    assert failed[-2].endswith("; quality gate FAILED: below evaluate.min_gain = 0.1")


def test_a_summary_from_before_the_intervals_prints_as_before():
    assert evaluate_lines(_run(OLD))[2:7] == [
        "  draft      accept len  accept rate  per position    tok/s",
        "  ---------  ----------  -----------  --------------  -----",
        "  trained         1.523        17.4%  0.30/0.14/0.08    345",
        "  untrained       1.003         0.1%  0.00/0.00/0.00    315",
        "  no draft                                              473",
    ]
    assert result("evaluate", OLD) == (
        "accept 1.52 (untrained 1.00), per position 0.30/0.14/0.08, 345 tok/s (473 without), lossless"
    )


def test_the_follow_summary_line_has_the_intervals():
    assert result("evaluate", NEW) == (
        "accept 1.37 [1.25, 1.62] (untrained 1.00), gain 0.37 [0.25, 0.61], per position 0.21/0.10/0.06, "
        "345 tok/s (473 without), lossless"
    )
