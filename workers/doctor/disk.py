"""The doctor's disk checks: room for the hidden states extract will write where they will be written, and an output folder that can be created and written.

The hidden states' bytes are tokens × layer ids × hidden_size × the dtype's bytes; tokens come
from prepare's summary when it ran, else from the dataset's size.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from eyas.state.runconfig import RunConfig
from eyas.workers.doctor.check import Check, failed, human_bytes, passed, warned
from eyas.workers.doctor.memoryestimate import DTYPE_BYTES

GROUP = "resources"  # the report's group of the GPU, memory, disk and streaming checks

# Without prepare's count, tokens are estimated from the data's bytes: ~4 bytes of JSON text
# per token errs high (JSON keys and escapes count as text), so the disk need does too.
BYTES_PER_TOKEN = 4
SAMPLE_BYTES = 32 * 2**20


def estimate_tokens(cfg: RunConfig, output_dir: str) -> tuple[int | None, str]:
    """(tokens to extract, where the figure comes from): prepare's summary if it ran, else an
    estimate from the dataset's size."""
    summary = Path(output_dir) / "prepare" / "summary.json"
    try:
        tokens = json.loads(summary.read_text())["tokens"]
        if isinstance(tokens, int):
            return tokens, f"prepare's summary ({summary})"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if cfg.data is None:
        return None, "no [data] and no prepare summary"
    from eyas.workers.data.reader import DataError, count_rows, data_files, row_byte_limit

    try:
        files = data_files(cfg.data.path)
    except DataError as exc:
        return None, str(exc)
    size = sum(f.stat().st_size for f in files)
    if size <= 8 * SAMPLE_BYTES:
        try:
            rows = count_rows(files, row_byte_limit(cfg.data.max_length))
        except DataError as exc:  # an array prepare refuses: the data check names it
            return None, str(exc).partition("; ")[0]
    else:
        # A large dataset: rows from the line density of its first bytes (reading all of it
        # would make the doctor as slow as prepare).
        sample = b""
        for f in files:
            with open(f, "rb") as fh:
                sample += fh.read(SAMPLE_BYTES - len(sample))
            if len(sample) >= SAMPLE_BYTES:
                break
        lines = sum(1 for line in sample.split(b"\n") if line.strip()) or 1
        rows = int(size * lines / len(sample))
    if cfg.data.limit:
        rows = min(rows, cfg.data.limit)
    if rows == 0:
        return 0, f"{cfg.data.path} holds no rows"
    mean = min(cfg.data.max_length, max(1, size // max(rows, 1) // BYTES_PER_TOKEN))
    return (
        rows * mean,
        f"estimate: {rows} rows × ~{mean} tokens (data size ÷ {BYTES_PER_TOKEN} B/token, "
        f"capped at max_length {cfg.data.max_length})",
    )


def existing_parent(path: str) -> Path:
    """The nearest existing folder at or above `path` (where the run's files will be created)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def disk(cfg: RunConfig, output_dir: str, num_ids: int, hidden: int | None, free: int | None = None) -> Check | None:
    """Bytes of the hidden states (tokens × ids × hidden × dtype, plus the int64 token ids)
    against the free space where they will be written. None without an extract stage."""
    if "extract" not in cfg.pipeline:
        return None
    tokens, source = estimate_tokens(cfg, output_dir)
    if tokens is None or hidden is None:
        why = source if tokens is None else "no hidden_size"
        return warned(
            GROUP,
            "disk",
            f"cannot estimate the hidden states' size ({why})",
            "make sure the output folder has room for tokens × layer ids × hidden_size × dtype bytes",
        )
    width = DTYPE_BYTES[cfg.target.dtype]
    need = tokens * (num_ids * hidden * width + 8)
    where = existing_parent(os.path.join(output_dir, "extract"))
    if free is None:
        free = shutil.disk_usage(where).free
    detail = (
        f"hidden states need {human_bytes(need)} ({tokens} tokens × {num_ids} ids × {hidden} × {width} B; "
        f"{source}); {human_bytes(free)} free at {where}"
    )
    data = {"need": need, "tokens": tokens, "free": free, "path": str(where)}
    if need > free:
        return failed(
            GROUP, "disk", detail, "point output_dir at a bigger disk, lower data.limit, or use fewer layer ids", **data
        )
    return passed(GROUP, "disk", detail, **data)


def writable(output_dir: str) -> Check:
    """The run's output folder can be created and written (a temp file, removed at once)."""
    target = Path(os.path.abspath(output_dir))
    if target.exists() and not target.is_dir():
        return failed(GROUP, "output dir", f"{target} is a file", "point output_dir at a folder")
    where = existing_parent(str(target))
    if not where.is_dir():
        return failed(
            GROUP,
            "output dir",
            f"{target} cannot be created: {where} is a file",
            "point output_dir at a folder under a writable directory",
        )
    try:
        with tempfile.NamedTemporaryFile(dir=where, prefix=".eyas-doctor-"):
            pass
    except OSError as exc:
        return failed(
            GROUP,
            "output dir",
            f"{where} is not writable ({exc.strerror or exc})",
            "point output_dir at a writable folder, or fix its permissions",
        )
    state = "exists" if target.exists() else f"will be created under {where}"
    return passed(GROUP, "output dir", f"{target} {state}, writable", path=str(target))
