"""state/trainsteps.py: its packing against speculators' own (the sampler the train stage uses),
its step counts against the train stage's plan, and the sizing rule's promises."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from speculators.train.distributed_batch_sampler import _assign_to_packed_batches

from eyas.state import trainsteps
from eyas.workers.stages.prepare import validation_rows
from eyas.workers.train import data as train_data


def _lengths(rng: random.Random, n: int, low: int, high: int, distinct: bool) -> list[int]:
    if distinct:
        return rng.sample(range(low, high), n)
    return [rng.randint(low, high) for _ in range(n)]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("budget", [256, 1024, 8192])
def test_pack_makes_speculators_batches_from_the_same_order(world, budget):
    rng = random.Random(world * 100_003 + budget)
    for trial in range(6):
        n = rng.randint(world, 400)
        # Distinct lengths: with ties, which of two equal samples lands on a rank is numpy's
        # argsort's choice; the steps are the same either way (checked below on ties, and on
        # samples over the budget, which both clip to it).
        lengths = _lengths(rng, min(n, budget - 1), 1, budget + 1, distinct=True)
        for rank in range(world):
            theirs = [[int(i) for i in b] for b in _assign_to_packed_batches(np.array(lengths), budget, rank, world)]
            assert trainsteps.pack(lengths, budget, world, rank) == theirs, (trial, rank)
        tied = _lengths(rng, n, 1, budget * 3 // 2, distinct=False)
        theirs = _assign_to_packed_batches(np.clip(np.array(tied), 0, budget), budget, 0, world)
        assert len(trainsteps.pack(tied, budget, world)) == len(theirs)


def test_one_rank_counts_the_same_without_lpt():
    """epoch_steps' shortcut for one rank (a greedy fill) against the packing itself."""
    rng = random.Random(7)
    for _ in range(20):
        lengths = _lengths(rng, rng.randint(1, 500), 1, 3000, distinct=False)
        budget = rng.choice([512, 1024, 2048])
        order = list(range(len(lengths)))
        random.Random(3).shuffle(order)
        shuffled = [lengths[i] for i in order]
        assert trainsteps.epoch_steps(lengths, budget, 1, seed=3) == len(trainsteps.pack(shuffled, budget, 1))


def test_step_counts_are_within_a_few_percent_of_the_train_stages_plan():
    """The train stage's own batches (workers/train/data.py: plan, numpy's shuffle) against the
    count here (the stdlib's shuffle): 3 % apart at most, the module's docstring says."""
    rng = random.Random(1)
    for _ in range(30):
        n, world = rng.randint(20, 3000), rng.choice([1, 2, 3, 4, 8])
        budget = rng.choice([512, 1024, 2048, 8192])
        lengths = [rng.randint(10, 1500) for _ in range(n)]
        for epoch in range(2):
            theirs = len(train_data.plan(lengths, budget, world, 0, 0, epoch))
            ours = trainsteps.epoch_steps(lengths, budget, world, 0, epoch)
            assert abs(theirs - ours) <= max(1, 0.03 * theirs), (n, world, budget, epoch, theirs, ours)


def test_fewer_rows_than_ranks_make_no_step():
    assert trainsteps.epoch_steps([100, 100], 1024, 3) == 0 == len(train_data.plan([100, 100], 1024, 3, 0, 0, 0))


def test_a_large_epoch_is_packed_on_a_part_and_scaled(monkeypatch):
    rng = random.Random(5)
    lengths = [rng.randint(20, 900) for _ in range(20_000)]
    exact = trainsteps.epoch_steps(lengths, 2048, 2)
    monkeypatch.setattr(trainsteps, "PACK_ROWS", 4000)
    assert abs(trainsteps.epoch_steps(lengths, 2048, 2) - exact) <= 0.03 * exact


def test_the_validation_rows_are_prepares():
    for n, fraction, seed in [(60, 0.05, 0), (300, 0.1, 0), (1, 0.5, 0), (1000, 0.2, 7), (5, 0.0, 0)]:
        assert trainsteps.validation_rows(n, fraction, seed) == validation_rows(n, fraction, seed)
    lengths = list(range(100, 160))
    held = set(validation_rows(60, 0.05, 0))
    assert trainsteps.training_lengths(lengths, 0.05, 0) == [n for i, n in enumerate(lengths) if i not in held]


def test_the_issues_config_takes_three_steps_and_its_sized_schedule_says_the_data_is_too_small():
    """60 chats of ~70 tokens (57 for training), the run config's defaults: 3 epochs of one step."""
    rng = random.Random(0)
    lengths = [rng.randint(19, 141) for _ in range(57)]
    assert trainsteps.total_steps(lengths, 8192, 1, 3) == 3
    sized = trainsteps.size(lengths, 1)
    assert sized.too_small
    assert (sized.epochs, sized.batch_tokens) == (trainsteps.MAX_EPOCHS, trainsteps.MIN_BATCH_TOKENS)
    assert sized.total_steps == trainsteps.total_steps(lengths, 1024, 1, 20) < trainsteps.MIN_STEPS
    assert sized.lr == 1e-3 and sized.warmup_steps == round(0.05 * sized.total_steps)
    assert "more than 20" in sized.why


@pytest.mark.parametrize(
    ("rows", "ranks", "low", "high"),
    [(300, 1, 20, 140), (300, 2, 20, 140), (2000, 1, 50, 400), (5000, 8, 100, 2000), (200_000, 1, 100, 2000)],
)
def test_the_sized_schedule_keeps_its_promises(rows, ranks, low, high):
    rng = random.Random(rows + ranks)
    lengths = [rng.randint(low, high) for _ in range(rows)]
    s = trainsteps.size(lengths, ranks)
    floor = trainsteps.batch_floor(lengths)
    assert s.batch_tokens & (s.batch_tokens - 1) == 0  # a power of two
    assert floor <= s.batch_tokens <= max(8192, floor)
    assert max(lengths) <= s.batch_tokens  # no sample is cut
    assert s.total_steps == trainsteps.total_steps(lengths, s.batch_tokens, ranks, s.epochs)
    assert s.steps_per_epoch == trainsteps.epoch_steps(lengths, s.batch_tokens, ranks)
    assert trainsteps.DEFAULT_EPOCHS <= s.epochs <= trainsteps.MAX_EPOCHS
    assert s.warmup_steps == round(0.05 * s.total_steps)
    low_lr, high_lr = trainsteps.LR_RANGE
    assert low_lr <= s.lr <= high_lr
    assert s.lr == float(f"{min(max(1e-3 * math.sqrt(200 / s.total_steps), low_lr), high_lr):.2g}")
    if s.too_small:
        assert s.epochs == trainsteps.MAX_EPOCHS and s.batch_tokens == floor
        assert s.total_steps < trainsteps.MIN_STEPS
        return
    assert s.total_steps >= trainsteps.MIN_STEPS
    if s.epochs == trainsteps.DEFAULT_EPOCHS and s.batch_tokens < 8192:
        # The largest batch that reaches the minimum in 3 epochs: twice it would not.
        assert trainsteps.total_steps(lengths, 2 * s.batch_tokens, ranks, 3) < trainsteps.MIN_STEPS
    if s.epochs > trainsteps.DEFAULT_EPOCHS:
        # More epochs only at the smallest batch, and no more than the minimum needs.
        assert s.batch_tokens == floor
        assert trainsteps.total_steps(lengths, floor, ranks, s.epochs - 1) < trainsteps.MIN_STEPS


def test_large_data_keeps_the_run_configs_batch_and_epochs():
    rng = random.Random(2)
    lengths = [rng.randint(200, 2000) for _ in range(200_000)]
    s = trainsteps.size(lengths, 8)
    assert (s.epochs, s.batch_tokens, s.too_small) == (3, 8192, False)
    assert s.total_steps > 10_000 and s.lr == float(f"{1e-3 * math.sqrt(200 / s.total_steps):.2g}") < 1.5e-4
    assert trainsteps.lr_for(20_000) == 1e-4 == trainsteps.lr_for(10**6)  # the run config's lr, and no lower


def test_the_threshold_the_readme_states():
    assert trainsteps.too_small_tokens(1) == 10_240
    assert trainsteps.too_small_tokens(2, 2048) == 40_960
