"""Atomic file writes: a reader sees the old file or the whole new one, never a torn one.

Write to a temp file in the same directory (so the rename stays on one filesystem), fsync
it, then os.replace it over the target. Stdlib only: the rank monitor imports this and
must start fast, so the temp name is made here rather than through `tempfile` (which pulls
in `random`, `shutil` and more for a name we can make unique from pid + counter).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_counter = itertools.count()

# safetensors (0.7 and later; its Rust core, through the `tempfile` crate) writes every file
# to a temp file of its own in the target's directory, ".tmp" + 6 random letters and digits,
# and renames it over the target when done. A kill mid-write leaves that file behind, under a
# name that says nothing of what it was for. save_pretrained writes through it too.
LIBRARY_TEMP_PREFIX = ".tmp"
LIBRARY_TEMP_RANDOM = 6


def is_library_temp(name: str) -> bool:
    """Whether `name` is a temp file a library (safetensors) names itself: ".tmpAbC123".
    None of eyas's own names look so: `atomic_path`'s end in ".tmp", temp dirs have a "-"."""
    rest = name[len(LIBRARY_TEMP_PREFIX) :]
    return (
        name.startswith(LIBRARY_TEMP_PREFIX) and len(rest) == LIBRARY_TEMP_RANDOM and rest.isascii() and rest.isalnum()
    )


def _temp_name(path: Path) -> Path:
    # Dot-prefixed so globs like rank-*.json never match a half-written file.
    return path.with_name(f".{path.name}.{os.getpid()}.{next(_counter)}.tmp")


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not every filesystem lets a directory be fsynced.
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], replace=os.replace) -> Iterator[Path]:
    """Yield a temp path next to `path`; on a clean exit fsync it and move it over `path`.

    For libraries that write a file themselves (safetensors' `save_file(tensors, tmp)`).
    On an exception the temp file is removed and `path` is left as it was. `replace(tmp, path)`
    does the move: a caller that counts its files (the streaming window's ledger,
    extract/stream.py) moves and counts under one lock.
    """
    path = Path(path)
    tmp = _temp_name(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:
            # os.write and os.fsync name no file: say which one could not be written (on a
            # full disk, the root cause names it: workers/runtime/fulldisk.py).
            exc.filename = str(path)
        raise
    _fsync_dir(path.parent)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` atomically (temp file in the same dir + fsync + os.replace)."""
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:  # os.write may write less than asked
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write `obj` as one JSON document (with a final newline) atomically."""
    write_text(path, json.dumps(obj, indent=1) + "\n")


def claim_json(path: str | os.PathLike[str], identity: dict) -> tuple[str, Any] | None:
    """Record `identity` at `path` unless a record is there, and say how it differs: the first
    key whose value differs and the recorded value, or None when the record matches.

    Many ranks and attempts may claim at once: the record is written under a temp name and
    hard-linked into place, so exactly one writer wins (a link fails where a name exists, where
    a rename would overwrite) and every other claim compares with what the winner wrote."""
    path = Path(path)
    if not path.exists():
        tmp = _temp_name(path)
        tmp.write_text(json.dumps(identity, indent=1, sort_keys=True) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another rank won: compare with what it wrote
        finally:
            tmp.unlink()
    recorded = json.loads(path.read_text())
    differ = [k for k in sorted(set(recorded) | set(identity)) if recorded.get(k) != identity.get(k)]
    return (differ[0], recorded.get(differ[0])) if differ else None
