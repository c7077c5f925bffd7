"""fp8 hidden-states files against bf16 ones: write and read throughput (and their ratio), and the size ratio.

The states are what a GPU extraction hands the writer: bf16, [seq, 4 layer ids, hidden], one
file per sample. Write: extract's own background writer (extract/hswriter.py: quantisation for
fp8, safetensors, fsync, rename), the clock running from the first put() to close(). Read: the
trainer's reader (extract/hsformat.py's read(), which dequantises fp8 to float32; bf16 comes back
as stored, memory-mapped: nothing is read until touched), and then the same to float32, which
touches every value (what the collation does on CPU; a GPU run casts to bf16 instead). The files
were just written, so reads come from the page cache: this measures the CPU cost of each format,
not the disk; on a disk-bound reader fp8's halved bytes count too.
Each measurement runs `--repeat` times and the fastest counts, since other work on a shared
machine only ever slows a measurement down.
Run: python tests/bench/bench_fp8.py [--hidden 4096 --seq 1024 --files 8 --repeat 3]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

N_IDS = 4  # three draft inputs and the verifier's last hidden state


def states(args):
    import torch

    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-1, 1, N_IDS).view(1, N_IDS, 1)  # layer ids of different magnitudes
    return [
        ((torch.randn(args.seq, N_IDS, args.hidden, generator=g) * scale).to(torch.bfloat16), torch.arange(args.seq))
        for _ in range(args.files)
    ]


def write(directory: Path, samples, hidden_dtype: str) -> float:
    from eyas.workers.extract import hswriter

    shutil.rmtree(directory, ignore_errors=True)
    writer = hswriter.HiddenStatesWriter(directory, hidden_dtype=hidden_dtype)
    t0 = time.perf_counter()
    for idx, (hidden, ids) in enumerate(samples):
        item = hswriter.Item(idx=idx, row=0, length=len(ids), token_ids=ids)
        writer.put(hswriter.Job(hidden=hidden.unsqueeze(0), items=[item]))
    writer.close()
    return time.perf_counter() - t0


def read(directory: Path, n: int, to_float32: bool) -> float:
    from eyas.workers.extract import hsformat, hswriter

    t0 = time.perf_counter()
    for idx in range(n):
        hidden = hsformat.read(directory / hswriter.file_name(idx)).hidden_states
        if to_float32:
            hidden.float().sum()  # a no-op cast for fp8's float32, so the sum forces the pages in for both
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    samples = states(args)
    tokens = args.seq * args.files
    root = Path(tempfile.mkdtemp(prefix="eyas-bench-fp8-"))
    try:
        best: dict[str, dict[str, float]] = {}
        for _ in range(args.repeat):
            for fmt in ("target", "fp8"):  # "target": the states' own dtype, bf16 here
                d = root / fmt
                times = {"write": write(d, samples, fmt), "read": read(d, args.files, False)}
                times["read_f32"] = read(d, args.files, True)
                b = best.setdefault(fmt, times)
                for k, v in times.items():
                    b[k] = min(b[k], v)
        size = {fmt: sum(f.stat().st_size for f in (root / fmt).iterdir()) for fmt in best}
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"{args.files} files of [{args.seq}, {N_IDS}, {args.hidden}] bf16 states "
        f"({tokens} tokens), best of {args.repeat}"
    )
    print(f"{'':6} {'write tok/s':>12} {'write MB/s':>11} {'read tok/s':>12} {'read->f32 tok/s':>16} {'bytes':>12}")
    states_mb = tokens * N_IDS * args.hidden * 2 / 1e6  # of bf16 states, for both formats
    for fmt, name in (("target", "bf16"), ("fp8", "fp8")):
        b = best[fmt]
        print(
            f"{name:6} {tokens / b['write']:12.0f} {states_mb / b['write']:11.1f} "
            f"{tokens / b['read']:12.0f} {tokens / b['read_f32']:16.0f} {size[fmt]:12d}"
        )
    print(
        f"fp8 / bf16: write throughput {best['target']['write'] / best['fp8']['write']:.3f}x, "
        f"read throughput {best['target']['read'] / best['fp8']['read']:.4f}x, "
        f"read->float32 throughput {best['target']['read_f32'] / best['fp8']['read_f32']:.3f}x, "
        f"size {size['fp8'] / size['target']:.4f}"
    )


if __name__ == "__main__":
    main()
