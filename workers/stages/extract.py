"""The `extract` stage: capture the target's hidden states for every sample.

Two backends share one plan, one set of files and one set of resume rules
(eyas.workers.extract: plan.py, output.py): `hf` (extract/hf.py: transformers, one model per
rank, data parallel over the ranks) and `vllm` (vllm/backend.py: one driver rank, its
tensor-parallel workers capture; the path for targets that need several GPUs).

Input: prepare's dataset (<output_dir>/prepare/dataset: input_ids, loss_mask, seq_len).
Output, under <output_dir>/extract/:
- hidden_states/hs_<idx>.safetensors, one per dataset row (speculators' offline format, see
  workers/extract/hswriter.py), with the layer ids in the run's order, the last one the verifier's
  last hidden state;
- data_config.json (rank 0, once every file exists): layers, dtypes, model, versions. No
  timestamps, so that a resumed run's output is byte-identical to an uninterrupted one.

Ranks split the samples (data parallel). The batches are a pure function of (dataset,
world_size, rank, batch_size) and never of what is already on disk: a retried attempt
recomputes exactly the batches an uninterrupted run computes, skips those whose files all
exist and writes only the missing files of the others. Same batch, same numbers, same bytes.
An output dir is bound to one extraction (extract/output.py: claim_output).
"""

from __future__ import annotations

from eyas.workers.extract.plan import Settings


def main(ctx) -> None:
    settings = Settings.from_context(ctx)
    if settings.backend == "vllm":
        from eyas.workers.vllm import backend
    else:
        from eyas.workers.extract import hf as backend
    backend.main(ctx, settings)
