"""Rank 0's end of regenerate: every rank's rows, in row order, become a dataset laid out as prepare's, published whole in `<output_dir>/regenerate/`, with the counts.

Outputs (as prepare's, so extract, vocab, train, evaluate and streaming read them unchanged,
through state/regenerate.py: data_dir):
- dataset/        the regenerated rows (input_ids, loss_mask = the target's tokens, seq_len),
                  written by prepare's own writer: the same columns, types and torch format;
                  a failed row is left out;
- splits.json     prepare's split, its rows renumbered past the rows left out;
- token_freq.npy  the masked tokens' counts, over the new rows (what vocab reads);
- summary.json    written last, removed first (prepare.publish): present means complete. It
                  records the counts, the sampling settings and the target.
The rows files stay: a retry of a later stage's failure, or of this one's, assembles the same
bytes again without generating anything. A dataset whose every row failed publishes nothing and
fails the stage with one line that says why and what to change.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from eyas.state import contract
from eyas.workers.data.target_vocab import target_vocab_size
from eyas.workers.regenerate import ledger
from eyas.workers.regenerate.rows import MAX_LENGTH, MAX_TOKENS, mask_of
from eyas.workers.regenerate.settings import Settings
from eyas.workers.runtime import atomic, phases

# prepare's own writer and publisher: the regenerated dataset must be byte-for-byte prepare's kind.
from eyas.workers.stages.prepare import _Rows as Rows
from eyas.workers.stages.prepare import publish

log = logging.getLogger("eyas.regenerate")

TMP_PREFIX = ".regenerate-tmp-"
EXAMPLES_PER_REASON = 3


class RegenerateFailed(RuntimeError):
    """No row could be regenerated: nothing to train on."""


def counts(rows: list[dict]) -> dict[str, Any]:
    """Rows finished, cut at max_tokens, cut at max_length, failed by reason; turns by how they ended."""
    failed = Counter(r["failed"] for r in rows if r.get("failed"))
    kept = [r for r in rows if not r.get("failed")]
    turns = Counter(end for r in kept for _, end in r["turns"])
    cut_tokens = sum(1 for r in kept if any(end == MAX_TOKENS for _, end in r["turns"]))
    cut_length = sum(1 for r in kept if r["cut"])
    return {
        "rows": len(rows),
        "rows_out": len(kept),
        "rows_finished": sum(1 for r in kept if not r["cut"] and all(end == "stop" for _, end in r["turns"])),
        "rows_cut_max_tokens": cut_tokens,
        "rows_cut_max_length": cut_length,
        "rows_failed": sum(failed.values()),
        "failed": dict(sorted(failed.items())),
        "turns": sum(turns.values()),
        "turns_by_end": {k: turns[k] for k in ("stop", MAX_TOKENS, MAX_LENGTH) if turns[k]},
        "tokens_generated": sum(n for r in kept for n, _ in r["turns"]),
    }


def failure_line(settings: Settings, rows: list[dict], c: dict) -> str:
    """Why every row failed, and what to change: one line."""
    parts = []
    for reason, n in c["failed"].items():
        if reason == "prompt_too_long":
            if settings.context < settings.max_length:
                parts.append(
                    f"{n} prompts leave no room for an answer in the target's context of {settings.context} tokens "
                    "(max_model_len); raise [stages.regenerate] options.vllm.max_model_len (at most the target's "
                    "max_position_embeddings) or shorten the prompts"
                )
            else:
                parts.append(
                    f"{n} prompts leave no room for an answer in data.max_length = {settings.max_length}; "
                    "raise data.max_length or shorten the prompts"
                )
        elif reason == "no_assistant_tokens":
            parts.append(f"{n} rows have no assistant token to regenerate; check prepare's loss masks")
        else:
            parts.append(
                f"{n} answers were the end-of-turn alone; check the target and [regenerate] stop_token_ids "
                f"({list(settings.stop_token_ids)})"
            )
    return f"all {c['rows']} rows failed: " + "; ".join(parts)


def splits(source_dir: Path, rows: list[dict]) -> dict[str, Any]:
    """prepare's split over the kept rows: the same rows held out, renumbered."""
    path = source_dir / "splits.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run the prepare stage first")
    old = json.loads(path.read_text())
    new_index, kept = {}, 0
    for r in rows:
        if not r.get("failed"):
            new_index[r["row"]] = kept
            kept += 1
    validation = [new_index[i] for i in old.get("validation", []) if i in new_index]
    return {**old, "rows": kept, "validation": validation, "source": "regenerate", "rows_left_out": len(rows) - kept}


def finish(ctx, settings: Settings, dataset, plan: list[list[int]], attempt: dict[str, int]) -> None:
    """Assemble, check and publish the dataset once every rank's rows are in; the attempt's summary."""
    done = ledger.finished(settings.out_dir, plan)
    missing = [b for b in range(len(plan)) if b not in done]
    if missing:
        raise RuntimeError(
            f"{ledger.rows_dir(settings.out_dir)}: {len(missing)} of {len(plan)} batches have no rows after every "
            f"rank finished (first: batch {missing[0]}, rows {plan[missing[0]][0]}..{plan[missing[0]][-1]})"
        )
    rows = [r for b in range(len(plan)) for r in done[b]["rows"]]
    c = counts(rows)
    _log_failures(rows)
    if c["rows_out"] == 0:
        raise RegenerateFailed(failure_line(settings, rows, c))
    out = settings.out_dir
    for old in out.glob(TMP_PREFIX + "*"):  # a crashed attempt's; only rank 0 writes here
        shutil.rmtree(old, ignore_errors=True)
    tmp = out / f"{TMP_PREFIX}{ctx.attempt}-{os.getpid()}"
    tmp.mkdir()
    try:
        built = Rows(target_vocab_size(settings.target_path))
        for r in rows:
            if not r.get("failed"):
                built.add(r["ids"], mask_of(len(r["ids"]), r["spans"]))
        with ctx.progress.beating("save dataset", kind="data", budget=phases.data_budget(ledger.rows_dir(out))):
            built.save(tmp / "dataset")
        summary = {
            **c,
            "trainable_tokens": built.trainable,
            "tokens": built.tokens,
            "source": str(settings.source_dir),
            "target": {"path": settings.target_path, "dtype": settings.dtype},
            "sampling": settings.sampling(),
            "tensor_parallel_size": settings.tensor_parallel_size,
            "engines": ctx.world_size,
            "batches": len(plan),
            "outputs": [str(out / name) for name in ("dataset", "token_freq.npy", "splits.json")],
        }
        with ctx.progress.beating("publish dataset", kind="data", budget=phases.data_budget(tmp)):
            publish(out, tmp, built.freq, splits(settings.source_dir, rows), summary)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    atomic.write_json(ctx.attempt_dir / contract.SUMMARY, {**summary, "attempt": attempt})
    ctx.progress.update(samples=c["rows"], samples_total=c["rows"], force=True)
    log.info(
        "regenerate: %d rows, %d out (%d finished, %d cut at max_tokens, %d cut at max_length), %d failed %s; "
        "%d tokens generated; this attempt generated %d rows and found %d done",
        c["rows"],
        c["rows_out"],
        c["rows_finished"],
        c["rows_cut_max_tokens"],
        c["rows_cut_max_length"],
        c["rows_failed"],
        c["failed"] or "",
        c["tokens_generated"],
        attempt["rows_generated"],
        attempt["rows_resumed"],
    )


def _log_failures(rows: list[dict]) -> None:
    seen: Counter[str] = Counter()
    for r in rows:
        reason = r.get("failed")
        if reason:
            seen[reason] += 1
            if seen[reason] <= EXAMPLES_PER_REASON:
                log.warning("row %d failed (%s): %s", r["row"], reason, r.get("detail", ""))
