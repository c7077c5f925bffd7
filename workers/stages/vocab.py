"""The `vocab` stage: the draft's vocabulary mapping, from prepare's token frequencies.

speculators' rule (speculators.train.vocab_mapping.build_vocab_mappings_from_distribution),
matched exactly and tested against it:
- the N = draft.vocab_size most frequent loss-masked tokens, ties broken by the lower id;
- if fewer than N distinct tokens were ever seen, the rest are the lowest ids (0, 1, ...) not
  chosen yet, so that the draft still has N outputs (logged as a warning);
- the chosen ids in ascending order; d2t[i] = target_id - i (int64 offsets, so target_id =
  draft_id + d2t[draft_id]); t2d = a bool mask over the target's vocabulary.
Saved as <output_dir>/vocab/d2t-<N>.npy and t2d-<N>.npy (np.save, no pickle), the names
speculators' trainer looks for. Files already there (a retry, or a mapping the user put
there) are reused if their sizes fit the run, and refused with a clear message if not.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from eyas.state import contract
from eyas.state.regenerate import data_dir
from eyas.state.runconfig import RunConfig
from eyas.workers.data.target_vocab import target_vocab_size
from eyas.workers.runtime import atomic

log = logging.getLogger("eyas.vocab")


class VocabError(ValueError):
    """The mapping cannot be built or reused for this run."""


def build_mapping(freq: np.ndarray, draft_vocab: int, target_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [draft_vocab], t2d bool [target_vocab]) from token counts, as speculators builds them."""
    if draft_vocab > target_vocab:
        raise VocabError(
            f"draft.vocab_size: {draft_vocab} exceeds the target's vocabulary ({target_vocab}); "
            f"use at most {target_vocab}"
        )
    seen = np.flatnonzero(freq)  # ascending ids
    order = np.lexsort((seen, -freq[seen]))  # by count, descending, then by id
    chosen = seen[order[:draft_vocab]]
    if len(chosen) < draft_vocab:
        # speculators pads with range(draft_vocab) minus the chosen: enough ids always remain there.
        pad = np.setdiff1d(np.arange(draft_vocab), chosen)[: draft_vocab - len(chosen)]
        chosen = np.concatenate([chosen, pad])
    chosen = np.sort(chosen).astype(np.int64)
    d2t = chosen - np.arange(draft_vocab, dtype=np.int64)
    t2d = np.zeros(target_vocab, dtype=bool)
    t2d[chosen] = True
    return d2t, t2d


def load_frequencies(path: Path, target_vocab: int) -> np.ndarray:
    """prepare's token_freq.npy, checked against the target."""
    if not path.exists():
        raise VocabError(f"{path} does not exist: run the prepare stage first (it counts the token frequencies)")
    try:
        freq = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise VocabError(f"{path}: not a numpy array file ({exc}); rerun prepare to rewrite it") from None
    if freq.ndim != 1 or not np.issubdtype(freq.dtype, np.integer):
        raise VocabError(f"{path}: expected a 1-D integer array, got {freq.dtype} {freq.shape}; rerun prepare")
    if len(freq) != target_vocab:
        raise VocabError(
            f"{path} counts {len(freq)} token ids but the target's vocab_size is {target_vocab}: "
            "it was counted for another target; rerun prepare for this one"
        )
    return freq.astype(np.int64, copy=False)


def load_cached(d2t_path: Path, t2d_path: Path, draft_vocab: int, target_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """A mapping already on disk, refused unless it fits the run exactly."""
    fix = "delete it to rebuild the mapping"
    arrays = []
    for path, dtype, size, what in (
        (d2t_path, np.int64, draft_vocab, "the run's draft.vocab_size"),
        (t2d_path, np.bool_, target_vocab, "the target's vocab_size"),
    ):
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise VocabError(f"{path}: the cached mapping is not a numpy array file ({exc}); {fix}") from None
        if arr.ndim != 1 or arr.shape[0] != size:
            raise VocabError(
                f"{path}: the cached mapping has shape {tuple(arr.shape)}, but {what} is {size}; "
                f"it was built for another run, {fix}"
            )
        if arr.dtype != dtype:
            raise VocabError(f"{path}: the cached mapping holds {arr.dtype}, not {np.dtype(dtype)}; {fix}")
        arrays.append(arr)
    d2t, t2d = arrays
    marked = int(t2d.sum())
    if marked != draft_vocab:
        raise VocabError(
            f"{t2d_path}: the cached mask marks {marked} tokens, but the run's draft.vocab_size is {draft_vocab}; {fix}"
        )
    if not np.array_equal(np.arange(draft_vocab) + d2t, np.flatnonzero(t2d)):
        raise VocabError(
            f"{d2t_path} and {t2d_path}: the cached d2t and t2d name different tokens; delete both "
            "to rebuild the mapping"
        )
    return d2t, t2d


def save_array(path: Path, arr: np.ndarray) -> None:
    with atomic.atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)


def main(ctx) -> None:
    cfg = RunConfig.from_dict(ctx.config)
    if cfg.target is None:
        raise VocabError("vocab needs [target] in the run's config (its vocab_size sizes the mapping); add it")
    n = cfg.draft.vocab_size
    v = target_vocab_size(cfg.target.path)
    if n > v:
        raise VocabError(
            f"draft.vocab_size: {n} exceeds the target's vocabulary ({v}, in "
            f"{cfg.target.path}/config.json); use at most {v}"
        )
    freq = load_frequencies(data_dir(ctx.output_dir, cfg.pipeline) / "token_freq.npy", v)  # prepare's or regenerate's
    d2t, t2d = build_mapping(freq, n, v)
    seen = int(np.count_nonzero(freq))
    if seen < n:
        log.warning(
            "only %d distinct trainable tokens were seen, fewer than draft.vocab_size %d: the other %d "
            "slots get the lowest unseen ids, as in speculators",
            seen,
            n,
            n - seen,
        )

    stage_dir = ctx.stage_dir
    d2t_path, t2d_path = stage_dir / f"d2t-{n}.npy", stage_dir / f"t2d-{n}.npy"
    cached = d2t_path.exists() and t2d_path.exists()
    matches = None
    if cached:
        old_d2t, old_t2d = load_cached(d2t_path, t2d_path, n, v)
        matches = bool(np.array_equal(old_d2t, d2t) and np.array_equal(old_t2d, t2d))
        if matches:
            log.info("reusing %s and %s: they equal the mapping of these frequencies", d2t_path.name, t2d_path.name)
        else:
            log.warning(
                "reusing the mapping already in %s (%s, %s), which differs from the one these token "
                "frequencies give; delete both files to rebuild it",
                stage_dir,
                d2t_path.name,
                t2d_path.name,
            )
        d2t, t2d = old_d2t, old_t2d
    else:
        save_array(d2t_path, d2t)
        save_array(t2d_path, t2d)

    total = int(freq.sum())
    coverage = float(freq[np.flatnonzero(t2d)].sum() / total) if total else 0.0
    summary = {
        "draft_vocab_size": n,
        "target_vocab_size": v,
        "seen_tokens": seen,
        "padded": max(0, n - seen),
        "coverage": coverage,
        "cached": cached,
        "cache_matches_frequencies": matches,
        "outputs": [str(d2t_path), str(t2d_path)],
    }
    log.info("vocab: %d of %d target tokens kept; they cover %.2f%% of the trainable tokens", n, v, 100 * coverage)
    atomic.write_json(ctx.attempt_dir / contract.SUMMARY, summary)
