"""Train's side of the streaming window (workers/extract/stream.py): wait for each step's shards, free them after the step in window mode, and keep a ledger of what every step trained on.

Train's batches are the offline plan's (workers/train/data.py: plan), so a streaming run and
the same run offline see the same batches; only when they are ready differs. Rank 0 says which
step it needs (stream/trainer.json) before waiting for it, so the extractor never holds back a
shard that step needs. The ledger (train/ledger/rank-<r>.jsonl, one line per step: epoch,
step, dataset rows) is cut back to the checkpoint a retried attempt resumes from, so it lists
exactly the samples the final draft was trained on, step by step.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from eyas.workers.extract import hswriter, stream

log = logging.getLogger("eyas.train")

LEDGER_DIR = "ledger"


class Feed:
    """One train rank's view of the stream."""

    def __init__(self, ctx, extract_dir: Path, prepare_dir: Path, out_dir: Path, lengths: list[int]):
        self.ctx, self.main = ctx, ctx.rank == 0
        self.extract_dir = extract_dir
        self.progress = ctx.progress
        # The plan comes once extract has loaded the target: train's first wait on extract,
        # counted with the others (wait below).
        waited = stream.wait_for(
            stream.plan_path(extract_dir),
            self.progress,
            "waiting for extract's stream plan (it loads the target first)",
        )
        self.waits = 1 if waited else 0  # times this rank waited for extract
        self.wait_s = waited
        self.stream = stream.load(extract_dir, prepare_dir, ctx.config or {}, lengths)
        if self.main:  # the last attempt's word, if it ended after saying it
            (extract_dir / stream.STREAM_DIR / stream.DONE).unlink(missing_ok=True)
        self.ledger = out_dir / LEDGER_DIR / f"rank-{ctx.rank}.jsonl"
        self.window = stream.Ledger(extract_dir)
        self.freed = 0

    def dir_for(self, epoch: int | None) -> Path:
        return self.stream.dir_for(epoch)

    def resume(self, epoch: int, step: int) -> None:
        """Cut the ledger back to (epoch, step), where this attempt resumes, and say so."""
        kept = []
        if self.ledger.exists():
            for line in self.ledger.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:  # a line cut by a kill
                    continue
                if (rec["epoch"], rec["step"]) < (epoch, step):
                    kept.append(line)
        self.ledger.parent.mkdir(parents=True, exist_ok=True)
        self.ledger.write_text("".join(f"{line}\n" for line in kept))
        if self.main:
            stream.publish_need(self.extract_dir, epoch, step)

    def wait(self, epoch: int | None, rows: list[int], step: int | None = None) -> None:
        """Until every shard of `rows` exists; rank 0 first says it needs step `step`."""
        if self.main and epoch is not None and step is not None:
            stream.publish_need(self.extract_dir, epoch, step)
        directory = self.dir_for(epoch)
        missing = [r for r in rows if not (directory / hswriter.file_name(r)).exists()]
        if not missing:
            return
        self.waits += 1
        t0 = time.monotonic()
        what = (
            f"waiting for extract: {len(missing)} shards of {'validation' if epoch is None else f'epoch {epoch + 1}'}"
        )
        with self.progress.beating(what, kind="wait", waits="extract"):
            for r in missing:
                path = directory / hswriter.file_name(r)
                while not path.exists():
                    time.sleep(stream.POLL_S)
        self.wait_s += time.monotonic() - t0

    def used(self, epoch: int, step: int, rows: list[int]) -> None:
        """After the step: its line in the ledger, and in window mode its shards freed."""
        with open(self.ledger, "a") as f:
            f.write(json.dumps({"epoch": epoch, "step": step, "rows": rows}) + "\n")
        if self.stream.keep:
            return
        directory = self.dir_for(epoch)
        # Deleted and uncounted under the window's lock: the extractor's admission reads the count.
        self.freed += self.window.free([directory / hswriter.file_name(r) for r in rows])

    def metrics(self) -> dict:
        return {"train_waits": self.waits, "train_wait_s": round(self.wait_s, 3), "shards_freed": self.freed}

    def done(self) -> None:
        if self.main:
            stream.mark_done(self.extract_dir)
