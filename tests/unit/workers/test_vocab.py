"""The vocab stage: speculators' d2t/t2d from token frequencies, the files, and the refusals."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from rank_context import rank_context
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

from eyas.state.drafttables import DraftConfig
from eyas.state.inputtables import TargetConfig
from eyas.state.runconfig import RunConfig
from eyas.workers.data.target_vocab import target_vocab_size
from eyas.workers.stages import vocab
from eyas.workers.stages.vocab import VocabError, build_mapping

V = 64


def speculators_mapping(freq: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    # speculators counts with a Counter: only ids that occurred are keys.
    counts = {int(i): int(freq[i]) for i in np.flatnonzero(freq)}
    d2t, t2d = build_vocab_mappings_from_distribution(counts, n, len(freq))
    assert (d2t.dtype, t2d.dtype) == (torch.int64, torch.bool)
    return d2t.numpy(), t2d.numpy()


@pytest.mark.parametrize("seed", range(8))
def test_equals_speculators_on_random_frequencies(seed):
    rng = np.random.default_rng(seed)
    v = int(rng.integers(2, 400))
    cases = [
        rng.integers(0, 4, v),  # many ties, some unseen
        rng.integers(0, 1000, v) * (rng.random(v) < 0.1),  # sparse: fewer seen than most N
        np.full(v, 7),  # all tied
        np.zeros(v, dtype=np.int64),  # nothing seen
    ]
    for freq in cases:
        for n in sorted({1, 2, v // 3 or 1, v // 2 or 1, v - 1 or 1, v}):
            d2t, t2d = build_mapping(freq.astype(np.int64), n, v)
            ref_d2t, ref_t2d = speculators_mapping(freq, n)
            assert (d2t.dtype, d2t.shape, t2d.dtype, t2d.shape) == (np.int64, (n,), np.bool_, (v,))
            assert np.array_equal(d2t, ref_d2t) and np.array_equal(t2d, ref_t2d), (seed, n)
            # The convention: target_id = draft_id + d2t[draft_id], and t2d marks exactly those.
            assert np.array_equal(np.flatnonzero(t2d), np.arange(n) + d2t)


def test_ties_go_to_the_lower_id():
    freq = np.array([0, 5, 3, 5, 3, 3, 0, 9], dtype=np.int64)
    d2t, t2d = build_mapping(freq, 4, 8)
    assert np.flatnonzero(t2d).tolist() == [1, 2, 3, 7]  # 9, then 5 (ids 1, 3), then 3 (id 2 of 2, 4, 5)
    assert d2t.tolist() == [1, 1, 1, 4]


# --- the stage ------------------------------------------------------------------------------


@pytest.fixture
def run(tmp_path):
    """Run the vocab stage on `freq` (as prepare's token_freq.npy) for a target of `target_vocab`."""
    target = tmp_path / "target"
    target.mkdir()

    def go(freq: np.ndarray | None, n: int, target_vocab: int = V, attempt: int = 1) -> dict:
        (target / "config.json").write_text(
            json.dumps({"model_type": "llama", "vocab_size": target_vocab, "num_hidden_layers": 2})
        )
        out = tmp_path / "out"
        if freq is not None:
            (out / "prepare").mkdir(parents=True, exist_ok=True)
            np.save(out / "prepare" / "token_freq.npy", freq)
        attempt_dir = tmp_path / f"attempt-{attempt}"
        attempt_dir.mkdir(exist_ok=True)
        cfg = RunConfig(name="v", target=TargetConfig(path=str(target)), draft=DraftConfig(vocab_size=n)).to_dict()
        ctx = rank_context("vocab", attempt_dir, out, cfg, attempt=attempt, run_id=1, master_port=29500)
        vocab.main(ctx)
        return json.loads((attempt_dir / "summary.json").read_text())

    go.stage = tmp_path / "out" / "vocab"
    return go


def _freq(seed: int = 0, seen: int = V) -> np.ndarray:
    rng = np.random.default_rng(seed)
    freq = np.zeros(V, dtype=np.int64)
    freq[rng.choice(V, seen, replace=False)] = rng.integers(1, 50, seen)
    return freq


def test_stage_writes_speculators_files(run):
    freq = _freq()
    summary = run(freq, 16)
    d2t_path, t2d_path = run.stage / "d2t-16.npy", run.stage / "t2d-16.npy"
    assert sorted(p.name for p in run.stage.iterdir()) == ["d2t-16.npy", "t2d-16.npy"]
    # Plain .npy headers (no pickled objects): int64 and bool.
    for path, descr, shape in ((d2t_path, "<i8", (16,)), (t2d_path, "|b1", (V,))):
        with open(path, "rb") as f:
            assert np.lib.format.read_magic(f) == (1, 0)
            header = np.lib.format.read_array_header_1_0(f)
        assert (header[0], header[2].str) == (shape, descr)
    d2t, t2d = np.load(d2t_path, allow_pickle=False), np.load(t2d_path, allow_pickle=False)
    ref_d2t, ref_t2d = speculators_mapping(freq, 16)
    assert np.array_equal(d2t, ref_d2t) and np.array_equal(t2d, ref_t2d)
    assert summary == {
        "draft_vocab_size": 16,
        "target_vocab_size": V,
        "seen_tokens": V,
        "padded": 0,
        "coverage": float(freq[t2d].sum() / freq.sum()),
        "cached": False,
        "cache_matches_frequencies": None,
        "outputs": [str(d2t_path), str(t2d_path)],
    }


def test_fewer_seen_tokens_than_the_draft_vocab_pad_like_speculators(run, caplog):
    freq = _freq(seed=3, seen=5)
    with caplog.at_level(logging.WARNING, logger="eyas.vocab"):
        summary = run(freq, 12)
    assert (summary["seen_tokens"], summary["padded"], summary["coverage"]) == (5, 7, 1.0)
    assert "only 5 distinct trainable tokens were seen, fewer than draft.vocab_size 12" in caplog.text
    t2d = np.load(run.stage / "t2d-12.npy")
    assert np.array_equal(t2d, speculators_mapping(freq, 12)[1])
    seen = set(np.flatnonzero(freq).tolist())
    assert set(np.flatnonzero(t2d).tolist()) - seen == set(sorted(set(range(12)) - seen)[:7])


def test_refuses_a_draft_vocab_larger_than_the_target(run):
    with pytest.raises(
        VocabError,
        match=r"^draft\.vocab_size: 65 exceeds the target's vocabulary \(64, in "
        r".*/target/config\.json\); use at most 64$",
    ):
        run(_freq(), 65)
    assert not run.stage.exists() or not any(run.stage.iterdir())


def test_refuses_token_frequencies_of_another_target(run, tmp_path):
    with pytest.raises(VocabError, match=r"token_freq\.npy does not exist: run the prepare stage first"):
        run(None, 8)
    with pytest.raises(VocabError, match=r"token_freq\.npy counts 100 token ids but the target's vocab_size is 64"):
        run(np.ones(100, dtype=np.int64), 8)


def test_refuses_a_cached_mapping_that_does_not_fit(run):
    run(_freq(), 16)
    d2t_path, t2d_path = run.stage / "d2t-16.npy", run.stage / "t2d-16.npy"
    good_d2t, good_t2d = np.load(d2t_path), np.load(t2d_path)

    np.save(d2t_path, np.zeros(20, dtype=np.int64))
    with pytest.raises(
        VocabError,
        match=rf"^{d2t_path}: the cached mapping has shape \(20,\), but the run's "
        r"draft\.vocab_size is 16; it was built for another run, delete it",
    ):
        run(_freq(), 16, attempt=2)
    np.save(d2t_path, good_d2t)

    np.save(t2d_path, np.zeros(100, dtype=bool))
    with pytest.raises(
        VocabError,
        match=rf"^{t2d_path}: the cached mapping has shape \(100,\), but the target's "
        r"vocab_size is 64",
    ):
        run(_freq(), 16, attempt=3)

    np.save(t2d_path, good_t2d.astype(np.int64))
    with pytest.raises(VocabError, match=rf"^{t2d_path}: the cached mapping holds int64, not bool"):
        run(_freq(), 16, attempt=4)

    shifted = good_t2d.copy()
    shifted[np.flatnonzero(~good_t2d)[0]] = True
    np.save(t2d_path, shifted)
    with pytest.raises(VocabError, match=r"the cached mask marks 17 tokens, but the run's draft\.vocab_size is 16"):
        run(_freq(), 16, attempt=5)

    np.save(t2d_path, np.roll(good_t2d, 1))  # 16 tokens, but not the ones d2t names
    with pytest.raises(VocabError, match="the cached d2t and t2d name different tokens"):
        run(_freq(), 16, attempt=6)


def test_reuses_a_cached_mapping_that_fits(run, caplog):
    run(_freq(0), 16)
    files = {p.name: p.read_bytes() for p in run.stage.iterdir()}
    again = run(_freq(0), 16, attempt=2)
    assert (again["cached"], again["cache_matches_frequencies"]) == (True, True)
    with caplog.at_level(logging.WARNING, logger="eyas.vocab"):
        stale = run(_freq(1), 16, attempt=3)  # other frequencies: the files stay, with a warning
    assert (stale["cached"], stale["cache_matches_frequencies"]) == (True, False)
    assert "differs from the one these token frequencies give; delete both files to rebuild it" in caplog.text
    assert {p.name: p.read_bytes() for p in run.stage.iterdir()} == files


def test_target_vocab_size_reads_text_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {"vocab_size": 163840}})
    )
    assert target_vocab_size(tmp_path) == 163840
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    with pytest.raises(ValueError, match=r"config\.json has no vocab_size \(nor text_config\.vocab_size\)"):
        target_vocab_size(tmp_path)
