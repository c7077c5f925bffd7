"""state/axes.py: the ticks of a linear, log and elapsed-time axis, their labels, TensorBoard's EMA and what an empty GPU plot says."""

from __future__ import annotations

import math

import pytest

from eyas.state import axes


def test_log_ticks_are_round_values_across_the_decades():
    # The demo's loss: 9.28 at step 0 down to 0.07.
    assert axes.log_ticks(0.07, 9.28, 5) == pytest.approx([0.1, 0.3, 1, 3])
    assert axes.log_ticks(0.07, 9.28, 8) == pytest.approx([0.1, 0.2, 0.5, 1, 2, 5])
    # Many decades: every k-th power of ten.
    assert axes.log_ticks(1e-6, 10, 4) == pytest.approx([1e-6, 1e-4, 1e-2, 1])
    # Within a decade: round linear values, at their log positions.
    assert axes.log_ticks(3.74, 6.4, 5) == pytest.approx([4, 5, 6])
    assert axes.log_ticks(0, 1, 5) == [] and axes.log_ticks(-1, 1, 5) == []


def test_time_ticks_give_two_at_least_where_there_is_room():
    assert axes.time_ticks(0, 7300, 2) == [0, 3600, 7200]
    assert axes.time_ticks(0, 100, 5) == [0, 30, 60, 90]
    assert axes.nice_ticks(0, 1, 3) == [0, 0.5, 1]


@pytest.mark.parametrize(
    "seconds, unit, text",
    [
        (0, "m:ss", "0:00"),
        (45, "m:ss", "0:45"),
        (750, "m:ss", "12:30"),
        (5400, "h:mm", "1:30"),
        (93600, "h:mm", "26:00"),
        (-30, "m:ss", "-0:30"),
    ],
)
def test_clock_faces(seconds, unit, text):
    assert axes.clock(seconds, unit) == text


def test_clock_unit_follows_the_span():
    assert axes.clock_unit(59 * 60) == "m:ss" and axes.clock_unit(3600) == "h:mm"


@pytest.mark.parametrize(
    "value, text",
    [
        (6896.5, "6.9k"),
        (48211, "48.2k"),
        (1.39149e8, "139M"),
        (950, "950"),
        (2.5, "2.5"),
        (0.012, "0.012"),
        (3e-4, "3.0e-4"),
        (0, "0"),
    ],
)
def test_tick_numbers_stay_short(value, text):
    assert axes.number(value) == text


def test_ema_is_tensorboards_debiased_average():
    values = [1.0, 0.0, 1.0, 0.0]
    w = 0.6
    # TensorBoard: last = last * w + (1 - w) * v; smoothed = last / (1 - w ** n).
    last, want = 0.0, []
    for n, v in enumerate(values, 1):
        last = last * w + (1 - w) * v
        want.append(last / (1 - w**n))
    assert axes.ema(values, w) == pytest.approx(want)
    assert axes.ema(values, w)[0] == 1.0  # debiased: the first point is the first value
    assert axes.ema(values, 0) == values
    assert axes.ema([2.0] * 5, 0.9) == [2.0] * 5  # a constant stays put, exactly
    smoothed = axes.ema([1.0, math.nan, 3.0], 0.5)
    assert smoothed[0] == 1.0 and math.isnan(smoothed[1]) and smoothed[2] == pytest.approx((0.5 * 0.5 + 1.5) / 0.75)


def test_ema_calms_a_noisy_series():
    noisy = [0.5 + (0.2 if k % 2 else -0.2) for k in range(200)]
    smoothed = axes.ema(noisy, axes.STRONG_SMOOTHING)
    assert max(smoothed[50:]) - min(smoothed[50:]) < 0.05 < max(noisy) - min(noisy)


def test_log_ready_needs_every_value_above_zero():
    assert axes.log_ready([9.28, 0.07]) and not axes.log_ready([1.0, 0.0]) and not axes.log_ready([])


def test_gpu_note_says_why_a_plot_is_empty():
    cpu = [{"devices": [], "slurm_job": None}]
    gpu = [{"devices": [0, 1], "slurm_job": None}]
    slurm = [{"devices": [], "slurm_job": "42"}]
    assert axes.gpu_note(cpu, daemon_gpu=False) == "no GPUs on this host"
    assert axes.gpu_note(gpu, daemon_gpu=False) == "no GPUs on this host"
    assert axes.gpu_note(cpu) == "no GPUs: this stage ran on CPU"
    assert axes.gpu_note(gpu, daemon_gpu=True) == "no samples"
    assert axes.gpu_note(slurm, daemon_gpu=False) == "no samples"  # its node's GPUs, not the daemon's
    assert axes.gpu_note([]) == "no samples"
