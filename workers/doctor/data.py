"""The doctor's data checks: every data file prepare would refuse, or whose rows it would skip,
is named with its fix before the run starts, from a bounded sample of each file.

Per file: empty, binary (NUL bytes in its first MBs), not UTF-8 (in its first MBs), a JSON
array too big to parse (data/reader.py: ARRAY_MAX_BYTES), lines over prepare's row byte limit
(reader.row_byte_limit; the first SCAN_BYTES of the data are scanned), and whether its
first rows parse as data.format. A file prepare would take no row from fails; one whose rows
it would partly skip warns. Reading is bounded too: lines are read through the same bounded
reader prepare uses, so a 200 MB line costs the doctor no more memory than it costs prepare.
"""

from __future__ import annotations

import codecs
import itertools
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eyas.state.inputtables import DataConfig
from eyas.workers.data import reader
from eyas.workers.doctor.check import Check, failed, human_bytes, passed, warned

GROUP = "data"
HEAD_BYTES = 4 << 20  # read from each file's start for the encoding and binary checks
SAMPLE_ROWS = 32  # rows of each file parsed and normalized as data.format
SCAN_BYTES = 1 << 30  # bytes of JSONL scanned for over-long lines, over all files
MAX_FILES = 64  # files of a directory examined (the rest: counted and sized only)


@dataclass
class _File:
    path: Path
    size: int
    refused: tuple[str, str] | None = None  # (what, fix): why prepare would take no row from it
    problems: list[tuple[str, str]] = field(default_factory=list)  # (what, fix): rows it would skip
    rows: int = 0  # rows sampled
    good: int = 0  # of which usable as data.format


def check(data: DataConfig) -> list[Check]:
    """The data checks of a run whose pipeline has prepare."""
    try:
        files = reader.data_files(data.path)
    except reader.DataError as exc:
        return [
            failed(
                GROUP,
                "path",
                str(exc).partition("; ")[0],
                str(exc).partition("; ")[2] or "point data.path at a .jsonl/.json file or a directory of them",
            )
        ]
    limit = reader.row_byte_limit(data.max_length)
    budget = [SCAN_BYTES]
    found = [_inspect(f, data.format, limit, budget) for f in files[:MAX_FILES]]
    size = sum(f.stat().st_size for f in files)
    where = f"{len(files)} file{'s' if len(files) != 1 else ''}, {human_bytes(size)}"
    checks = []
    usable = [f for f in found if not f.refused]
    for f in found:
        name = str(f.path)
        if f.refused:
            # Alone (or with every other file refused too) the stage would fail outright.
            make = failed if not usable or len(files) == 1 else warned
            checks.append(make(GROUP, f.path.name, f"{name}: {f.refused[0]}", f.refused[1], path=name))
        for what, fix in f.problems:
            checks.append(warned(GROUP, f.path.name, f"{name}: {what}", fix, path=name))
    if not checks:
        sampled = sum(f.rows for f in found)
        scanned = f" (lines scanned in the first {human_bytes(SCAN_BYTES)})" if budget[0] == 0 else ""
        checks.append(
            passed(
                GROUP,
                "rows",
                f"{where}: {sampled} sampled rows parse as data.format "
                f'"{data.format}"; no row over {limit} bytes{scanned}',
                files=len(files),
                bytes=size,
            )
        )
    return checks


def _inspect(path: Path, fmt: str, limit: int, budget: list[int]) -> _File:
    f = _File(path, path.stat().st_size)
    if f.size == 0:
        f.refused = ("the file is empty", "remove it, or point data.path at the dataset")
        return f
    with open(path, "rb") as fh:
        head = fh.read(HEAD_BYTES)
    if b"\0" in head:
        f.refused = (
            "NUL bytes in its first MBs: a binary file, not JSON/JSONL text",
            "point data.path at the JSONL/JSON text (decompress or export it first)",
        )
        return f
    bad = _not_utf8(head, at_end=len(head) == f.size)
    if bad:
        f.problems.append(
            (
                bad,
                f"convert it to UTF-8, e.g. iconv -f latin1 -t utf-8 {path} > {path}.utf8 "
                "(rows with such bytes are skipped as not_utf8)",
            )
        )
    # An array too big to parse is refused by read_rows below, before it reads a byte of it.
    if not reader.is_array_head(head):
        long_lines, longest, lines, whole = _scan(path, limit, budget)
        if long_lines:
            what = (
                f"{long_lines} line{'s' if long_lines != 1 else ''} over the {limit}-byte row limit"
                f"{'' if whole else ' in its part scanned'} (the longest {human_bytes(longest)})"
            )
            fix = (
                f"split or drop those rows, or raise data.max_length (the limit is max_length × "
                f"{reader.ROW_BYTES_PER_TOKEN} bytes, at least {human_bytes(reader.ROW_BYTES_MIN)})"
            )
            if long_lines == lines and whole:
                f.refused = (f"{what}, and no other row: prepare would skip every row as too_long", fix)
                return f
            f.problems.append((f"{what}: prepare skips them as too_long", fix))
    try:
        rows = list(itertools.islice(reader.read_rows([path], limit), SAMPLE_ROWS))
    except reader.DataError as exc:
        problem, _, fix = str(exc).partition("; ")
        f.refused = (problem.partition(": ")[2], fix or "fix the file")
        return f
    reasons: Counter[str] = Counter()
    for raw in rows:
        try:
            if raw.error is not None:
                raise raw.error
            reader.normalize(raw.value, fmt, sys.maxsize)  # ids are checked against the vocabulary by prepare
        except reader.RowError as err:
            if err.reason != "too_long":  # reported by the scan above
                reasons[err.reason] += 1
            continue
        f.good += 1
    f.rows = len(rows)
    if reasons:
        counts = ", ".join(f"{r} {n}" for r, n in reasons.items())
        fix = "fix those rows or data.format (auto, sharegpt, openai, tokenized); prepare skips and counts them"
        if f.good == 0:
            f.refused = (f'none of its first {len(rows)} rows parses as data.format "{fmt}" ({counts})', fix)
        else:
            f.problems.append(
                (
                    f"{sum(reasons.values())} of its first {len(rows)} rows do not parse as "
                    f'data.format "{fmt}" ({counts})',
                    fix,
                )
            )
    return f


def _not_utf8(head: bytes, at_end: bool) -> str:
    """Where `head` stops being UTF-8, or "" (a character cut at the sample's end is fine)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=at_end)
    except UnicodeDecodeError as exc:
        return f"byte 0x{head[exc.start]:02x} at offset {exc.start} is not UTF-8 (Latin-1 or another legacy encoding?)"
    return ""


def _scan(path: Path, limit: int, budget: list[int]) -> tuple[int, int, int, bool]:
    """(lines over `limit`, the longest of them, non-blank lines, whether the whole file was
    read) within what is left of the scan budget shared by all files (budget[0], reduced here)."""
    long_lines = longest = lines = 0
    whole = True
    with open(path, "rb") as fh:
        for _, line, length in reader.lines(fh, limit):
            if fh.tell() > budget[0]:
                whole = False
                break
            lines += 1
            if line is None:
                long_lines += 1
                longest = max(longest, length)
        budget[0] = max(0, budget[0] - fh.tell())
    return long_lines, longest, lines, whole
