"""The time a rank-log line carries, for merging ranks' logs in time order.

Shared by `eyas logs` and the TUI. Stdlib only.
"""

from __future__ import annotations

import re

# Timestamps written by Python logging (`2026-12-02 13:05:01,123`), ISO 8601
# (`2026-12-02T13:05:01.123`) and vLLM (`INFO 12-02 13:05:01 [file.py:12]`, the level maybe
# coloured), in one pattern so that a line is searched once. Looked for near the start of
# a line only: a date quoted in a message is not the line's time.
TIME = re.compile(
    r"(?:(\d{4}-\d\d-\d\d)[ T]|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)(?:\x1b\[[0-9;]*m)* (\d\d-\d\d) )"
    r"(\d\d:\d\d:\d\d)(?:[.,](\d{1,9}))?"
)
HEAD = 80


def stamp(line: str, year: str, monthday: str) -> str | None:
    """The sortable local time `YYYY-MM-DD HH:MM:SS.ffffff` a line starts with, or None.

    vLLM omits the year: it is `year`, or the next one for a month-day before `monthday`
    (the attempt's start: an attempt that ran over New Year). Strings, not tuples of ints:
    fixed-width fields sort the same and cost a third.
    """
    m = TIME.search(line, 0, HEAD)
    return None if m is None else from_match(m, year, monthday)


def from_match(m: re.Match, year: str, monthday: str) -> str:
    date, vllm_day, hms, frac = m.groups()
    if date is None:
        date = (year if vllm_day >= monthday else str(int(year) + 1)) + "-" + vllm_day
    return date + " " + hms + "." + (frac[:6].ljust(6, "0") if frac else "000000")
