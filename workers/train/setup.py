"""The Trainer's setup (workers/train/loop.py): the prepared dataset and extract's hidden states turned into this rank's batch plans, and the draft built and wrapped for DDP or FSDP.

A mixin of Trainer, read with it: its methods use the trainer's ctx, settings (`s`), `main` and
`dist`, and set the data and plans the loop runs over.
"""

from __future__ import annotations

import logging

import torch

from eyas.workers.extract import stream
from eyas.workers.train import data as train_data
from eyas.workers.train import model as train_model

log = logging.getLogger("eyas.train")


class Setup:
    """Trainer's setup: `_data` (the datasets and batch plans), `_model` (the draft), `_wrap` (DDP or FSDP)."""

    def _data(self) -> None:
        from datasets import load_from_disk

        s, ctx = self.s, self.ctx
        ds_path = s.prepare_dir / "dataset"
        if not ds_path.is_dir():
            raise train_data.DataError(f"{ds_path}: no prepared dataset; run the prepare stage first")
        dataset = load_from_disk(str(ds_path))
        self.feed = None
        if s.streaming:
            from eyas.workers.train.feed import Feed

            all_lengths = [int(n) for n in dataset.with_format(None)["seq_len"]]
            self.feed = Feed(ctx, s.extract_dir, s.prepare_dir, s.out_dir, all_lengths)
            stream.wait_for(
                s.extract_dir / "data_config.json",
                self.progress,
                "waiting for extract's data_config.json",
                waits="extract",
            )
        self.layout = train_data.read_layout(s.extract_dir)
        train_rows, val_rows = train_data.read_splits(s.prepare_dir, len(dataset))
        self.train_rows, self.val_rows = train_rows, val_rows
        if len(train_rows) < ctx.world_size:
            raise train_data.DataError(
                f"{len(train_rows)} training rows cannot feed {ctx.world_size} ranks; add data or lower resources.ranks"
            )
        hs_dir = s.extract_dir / train_data.HS_DIR
        self.hs_dtype = torch.bfloat16 if s.device == "cuda" else torch.float32
        self.collate = train_data.collate_fn(s.batch_tokens, self.layout, self.hs_dtype)
        complete = self.feed is None
        self.train_set = train_data.HiddenStatesDataset(
            dataset, train_rows, hs_dir, self.layout, s.batch_tokens, complete
        )
        self.val_set = (
            train_data.HiddenStatesDataset(dataset, val_rows, hs_dir, self.layout, s.batch_tokens, complete)
            if val_rows
            else None
        )
        lengths = self.train_set.approx_lengths
        self.lengths = lengths
        longest = max(lengths)
        if longest > s.batch_tokens and self.main:
            log.warning(
                "samples up to %d tokens are cut at train.batch_tokens = %d; raise it to train on them whole",
                longest,
                s.batch_tokens,
            )
        self.plans = [
            train_data.plan(lengths, s.batch_tokens, ctx.world_size, ctx.rank, s.seed, e) for e in range(s.epochs)
        ]
        if not self.plans[0]:
            raise train_data.DataError("no training batch could be packed; lower train.batch_tokens")
        self.total_steps = sum(len(p) for p in self.plans)
        self.val_plan = (
            train_data.plan(self.val_set.approx_lengths, s.batch_tokens, ctx.world_size, ctx.rank, s.seed, 0)
            if self.val_set
            else []
        )
        if self.val_set and not self.val_plan and self.main:
            log.warning("%d validation rows are fewer than the %d ranks: no validation", len(val_rows), ctx.world_size)
        self.n_train, self.n_val = len(train_rows), len(val_rows)

    def _tokens(self, batch: list[int]) -> int:
        return train_data.batch_tokens_of(batch, self.lengths, self.s.batch_tokens)

    def _done_before(self, epoch: int, step: int) -> tuple[int, int]:
        """(samples, tokens) this rank has trained on before batch `step` of `epoch`."""
        done = [b for e in range(min(epoch, len(self.plans))) for b in self.plans[e]]
        if epoch < len(self.plans):
            done += self.plans[epoch][:step]
        return sum(len(b) for b in done), sum(self._tokens(b) for b in done)

    def _model(self):
        s = self.s
        torch.manual_seed(s.seed)  # the same initial draft on every rank, and on every retry
        return train_model.build(
            s.target_path,
            self.layout.aux_ids,
            s.draft_vocab,
            s.num_layers,
            s.ttt_steps,
            s.vocab_dir,
            s.attn_impl,
            s.trust_remote_code,
        )

    def _wrap(self, model):
        s = self.s
        model.to(s.device)
        if not self.dist.active:
            return model
        if s.strategy == "fsdp":
            from speculators.train.distributed import apply_fully_sharded

            return self.dist.track(apply_fully_sharded(model, param_dtype=self.hs_dtype))
        from torch.nn.parallel import DistributedDataParallel

        # The vocab maps are constant buffers: synced once at init, never again every forward.
        return self.dist.track(
            DistributedDataParallel(
                model,
                device_ids=[torch.cuda.current_device()] if s.device == "cuda" else None,
                forward_sync_buffers=False,
            )
        )
