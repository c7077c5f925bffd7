"""Training throughput: the train stage under a real daemon, at 1 and 2 ranks, against a bare
loop over the same speculators model with no eyas around it.

The inputs are synthetic but shaped like a run's (built once, kept in the temp dir): a random
Llama target (hidden 256, 4 layers, the tiny BPE vocabulary), a prepared dataset of 256-token
samples, random hidden-state files for layer ids [1, 2, 3, 4] and a vocab mapping of 256 tokens.
Every measurement trains one epoch on the same packed batches (speculators' multipack of the
same training rows, seed 0, 1024 tokens per rank and step) with the same draft:

- bare: Eagle3DraftModel built as `speculators train` builds it, speculators' collation, AdamW,
  clipping and a linear schedule in a plain loop: no progress file, no metric reduction, no
  validation, no checkpoint. At 2 ranks: DDP over gloo, two processes started by this script.
- eyas: `pipeline = ["train"]` submitted to a real daemon (rank monitor, runtime, sampler);
  the stage summary's tok_s.
Both count throughput the same way: tokens over wall time in the loop, step to step (data
loading included), the first step (warm-up) left out; validation and checkpoints are outside.
Each CPU rank gets cores / ranks threads in both. Each measurement runs twice, in a symmetric
order, and the faster counts: other load on a shared machine only ever slows one down.
Target: eyas / bare >= 0.95 at 1 rank. Run: python tests/bench/bench_train.py [--samples 52]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, LAYERS, INTERMEDIATE, HEADS = 256, 4, 768, 4
SEQ, BATCH_TOKENS, DRAFT_VOCAB, VAL_ROWS = 256, 1024, 256, 4
LAYER_IDS = (1, 2, 3, 4)
TARGET_RATIO = 0.95
CACHE = Path(tempfile.gettempdir()) / "eyas-bench-train-v2"
MODEL_INPUTS = (
    "hidden_states",
    "input_ids",
    "document_ids",
    "loss_mask",
    "position_ids",
    "verifier_last_hidden_states",
)
TESTS = Path(__file__).resolve().parent.parent


def build_inputs(root: Path, samples: int) -> tuple[Path, Path]:
    """(target dir, an output dir holding prepare/, extract/ and vocab/), built once."""
    target, out = root / "target", root / f"out-{samples}"
    if (out / "vocab" / f"d2t-{DRAFT_VOCAB}.npy").exists():
        return target, out
    import datasets
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.workers.models.assets import build_tokenizer
    from eyas.workers.stages.vocab import build_mapping

    tok = build_tokenizer(target)
    vocab = len(tok)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(target)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(8, vocab, (samples, SEQ), generator=g)
    ds = datasets.Dataset.from_dict(
        {"input_ids": rows.tolist(), "loss_mask": [[1] * SEQ] * samples, "seq_len": [SEQ] * samples}
    )
    ds.set_format("torch")
    ds.save_to_disk(str(out / "prepare" / "dataset"))
    (out / "prepare" / "splits.json").write_text(json.dumps({"validation": list(range(VAL_ROWS))}))
    hs = out / "extract" / "hidden_states"
    hs.mkdir(parents=True)
    for i in range(samples):
        save_file(
            {"hidden_states": torch.randn(SEQ, len(LAYER_IDS), HIDDEN, generator=g), "token_ids": rows[i].clone()},
            hs / f"hs_{i}.safetensors",
        )
    (out / "extract" / "data_config.json").write_text(
        json.dumps(
            {"layer_ids": list(LAYER_IDS), "num_hidden_layers": LAYERS, "hidden_size": HIDDEN, "dtype": "float32"}
        )
    )
    freq = np.bincount(rows.flatten().numpy(), minlength=vocab)
    d2t, t2d = build_mapping(freq, DRAFT_VOCAB, vocab)
    (out / "vocab").mkdir()
    np.save(out / "vocab" / f"d2t-{DRAFT_VOCAB}.npy", d2t)
    np.save(out / "vocab" / f"t2d-{DRAFT_VOCAB}.npy", t2d)
    return target, out


# --- bare -------------------------------------------------------------------------------------


def bare(target: Path, out: Path, rank: int, world: int, port: int) -> dict:
    """One rank of the bare loop, in this (fresh) process."""
    import torch

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    import numpy as np
    from datasets import load_from_disk
    from safetensors.torch import load_file
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.data import CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from transformers import get_linear_schedule_with_warmup

    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ds = load_from_disk(str(out / "prepare" / "dataset"))
    held = set(json.loads((out / "prepare" / "splits.json").read_text())["validation"])
    rows = [i for i in range(len(ds)) if i not in held]
    lengths = [int(n) for n in ds.with_format(None)["seq_len"]]
    sampler = MultipackDistributedBatchSamplerV2(BATCH_TOKENS, [lengths[r] for r in rows], world, rank, seed=0)
    sampler.set_epoch(0)
    batches = list(sampler)

    def item(k: int) -> dict:
        row = rows[k]
        f = load_file(out / "extract" / "hidden_states" / f"hs_{row}.safetensors")
        h, n = f["hidden_states"], f["hidden_states"].shape[0]
        return {
            "hidden_states": h[:, :-1].flatten(1),
            "input_ids": f["token_ids"],
            "verifier_last_hidden_states": h[:, -1],
            "loss_mask": ds[row]["loss_mask"],
            "lengths": torch.tensor([n]),
            "position_ids": torch.arange(n),
        }

    torch.manual_seed(0)
    layer_cfg = create_transformer_layer_config(
        str(target),
        num_layers=1,
        draft_arch="llama",
        hidden_act="silu",
        sliding_window=2048,
        full_attention_indices=[0],
    )
    d2t = torch.from_numpy(np.load(out / "vocab" / f"d2t-{DRAFT_VOCAB}.npy"))
    t2d = torch.from_numpy(np.load(out / "vocab" / f"t2d-{DRAFT_VOCAB}.npy"))
    model = Eagle3DraftModel.from_training_args(
        layer_cfg,
        t2d=t2d,
        d2t=d2t,
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=True,
        norm_before_fc=True,
        norm_output=True,
        ttt_steps=3,
        verifier_name_or_path=str(target),
        target_layer_ids=list(LAYER_IDS[:-1]),
        draft_attn_impl="sdpa",
    )
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, forward_sync_buffers=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    sched = get_linear_schedule_with_warmup(opt, 0, len(batches))
    collate = CollateFn(
        BATCH_TOKENS, HIDDEN, num_target_layers=len(LAYER_IDS) - 1, dtype=torch.float32, preprocess=shift_batch
    )
    loss_config = resolve_loss_config("kl_div", "eager")
    tokens, seconds, cpu_seconds = 0, 0.0, 0.0
    last, last_cpu = time.perf_counter(), time.process_time()
    for k, b in enumerate(batches):
        batch = collate([item(i) for i in b])
        _, loss, _ = model(
            **{key: batch[key] for key in MODEL_INPUTS}, ttt_steps=3, ttt_step_loss_decay=1.0, loss_config=loss_config
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        n = int((batch["document_ids"] != -1).sum())
        now, cpu = time.perf_counter(), time.process_time()
        if k:
            tokens += n
            seconds += now - last
            cpu_seconds += cpu - last_cpu
        last, last_cpu = now, cpu
    if world > 1:
        dist.destroy_process_group()
    return {"tokens": tokens, "seconds": seconds, "cpu_seconds": cpu_seconds, "steps": len(batches)}


def measure_bare(target: Path, out: Path, world: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                "bare",
                "--target",
                str(target),
                "--out",
                str(out),
                "--rank",
                str(r),
                "--world",
                str(world),
                "--port",
                str(port),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    results = []
    for p in procs:
        stdout, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"bare rank exited {p.returncode}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    tokens = sum(r["tokens"] for r in results)
    seconds = sum(r["seconds"] for r in results) / world
    return {
        "tok_s": tokens / seconds,
        "tok_per_cpu_s": tokens / sum(r["cpu_seconds"] for r in results),
        "steps": results[0]["steps"],
    }


# --- eyas -------------------------------------------------------------------------------------

TOML = """\
name = "bench-train"
pipeline = ["train"]
output_dir = "{out}"
[target]
path = "{target}"
dtype = "float32"
[resources]
ranks = {ranks}
devices = "cpu"
[draft]
vocab_size = {vocab}
[train]
epochs = 1
lr = 1e-3
batch_tokens = {batch_tokens}
"""


def measure_eyas(daemon, target: Path, inputs: Path, scratch: Path, world: int) -> dict:
    out = scratch / f"eyas-{world}-{time.monotonic_ns()}"
    out.mkdir()
    for stage in ("prepare", "extract", "vocab"):
        (out / stage).symlink_to(inputs / stage)
    run_id = daemon.submit(
        TOML.format(out=out, target=target, ranks=world, vocab=DRAFT_VOCAB, batch_tokens=BATCH_TOKENS),
        f"bench-{world}.toml",
    )
    run = daemon.wait_run(run_id, timeout=900)
    if run["state"] != "succeeded":
        raise RuntimeError(f"eyas run {run_id} {run['state']}: {run['reason']}")
    summary = {s["name"]: s for s in run["stages"]}["train"]["summary"]
    shutil.rmtree(out / "train", ignore_errors=True)
    return {"tok_s": summary["tok_s"], "tok_per_cpu_s": summary["tok_per_cpu_s"], "steps": summary["steps"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=68, help="256-token samples (4 held out for validation)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each kind at each rank count")
    parser.add_argument("--ranks", default="1,2", help="the rank counts to measure, e.g. 1 or 1,2")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "bare":
        print(json.dumps(bare(Path(args.target), Path(args.out), args.rank, args.world, args.port)))
        return 0

    sys.path.insert(0, str(TESTS / "support"))
    from daemon_harness import Daemon, bench_home

    CACHE.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    target, inputs = build_inputs(CACHE, args.samples)
    print(
        f"draft: 1 Llama layer, hidden {HIDDEN}, draft vocab {DRAFT_VOCAB}, 3 TTT steps, fp32 on "
        f"{len(os.sched_getaffinity(0))} CPUs; {args.samples - VAL_ROWS} training samples x {SEQ} tokens, "
        f"{BATCH_TOKENS} tokens per rank and step, 1 epoch",
        flush=True,
    )
    home = bench_home()
    daemon = Daemon(home).start()
    results: dict[int, dict[str, list[dict]]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="eyas-bench-train-") as scratch:
            for world in [int(w) for w in args.ranks.split(",")]:
                runs: dict[str, list[dict]] = {"bare": [], "eyas": []}
                # Alternating, each pair in the other order, so that a drift in the machine's load
                # favours neither.
                for mode in [m for r in range(args.repeats) for m in (("bare", "eyas"), ("eyas", "bare"))[r % 2]]:
                    r = (
                        measure_bare(target, inputs, world)
                        if mode == "bare"
                        else measure_eyas(daemon, target, inputs, Path(scratch), world)
                    )
                    runs[mode].append(r)
                    print(
                        f"  {world} rank(s) {mode:<4} {r['tok_s']:8.0f} tok/s  {r['tok_per_cpu_s']:8.0f} tok/CPU-s "
                        f"({r['steps']} steps)",
                        flush=True,
                    )
                results[world] = runs
    finally:
        daemon.cleanup()
        shutil.rmtree(home, ignore_errors=True)
    code = 0
    for world, runs in results.items():
        b = max(r["tok_s"] for r in runs["bare"])
        e = max(r["tok_s"] for r in runs["eyas"])
        verdict = ""
        if world == 1:
            ok = e / b >= TARGET_RATIO
            verdict = f" (target >= {TARGET_RATIO:.2f}: {'met' if ok else 'MISSED'})"
            code = 0 if ok else 1
        print(f"{world} rank(s): eyas {e:.0f} tok/s / bare {b:.0f} tok/s = {e / b:.3f}{verdict}")
        cb = max(r["tok_per_cpu_s"] for r in runs["bare"])
        ce = max(r["tok_per_cpu_s"] for r in runs["eyas"])
        print(f"           per CPU-second (less sensitive to other load on the machine): {ce / cb:.3f}")
    if 1 in results and 2 in results:
        best = {(w, m): max(r["tok_s"] for r in results[w][m]) for w in (1, 2) for m in ("eyas", "bare")}
        print(
            f"2 ranks / 1 rank: eyas {best[2, 'eyas'] / best[1, 'eyas']:.2f}x, "
            f"bare {best[2, 'bare'] / best[1, 'bare']:.2f}x"
        )
    print(f"total {time.perf_counter() - t0:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
