"""Output shared by the listing commands, in sqlite-utils' manner: --json, --csv, --nl or a table.

Machine formats carry raw values (unix times as ISO 8601 UTC strings, seconds, bytes); the
table carries human ones (local minutes, `3m05s`, `12.3 GiB`, `1,234`). rich is imported
only to draw a table on a terminal, so the machine formats stay a few milliseconds.
"""

from __future__ import annotations

import csv
import json
import sys


def text(x) -> str:
    return "" if x is None else str(x)


class Column:
    """One column: its key in the row dicts, how a table shows it, how JSON/CSV carry it."""

    __slots__ = ("key", "human", "raw", "right")

    def __init__(self, key: str, human=text, raw=None, right: bool = False):
        self.key, self.human, self.raw, self.right = key, human, raw, right


def machine_rows(rows: list[dict], columns: list[Column]) -> list[dict]:
    return [{c.key: (c.raw(r[c.key]) if c.raw else r[c.key]) for c in columns} for r in rows]


def emit(rows: list[dict], columns: list[Column], fmt: str | None, out=None) -> None:
    """Write `rows` as `fmt` ("json", "csv", "nl", "table" or None for the table)."""
    out = out or sys.stdout
    if fmt in ("json", "csv", "nl"):
        emit_raw(machine_rows(rows, columns), [c.key for c in columns], fmt, out)
        return
    header = [c.key for c in columns]
    cells = [[c.human(r[c.key]) for c in columns] for r in rows]
    right = [c.right for c in columns]
    if out.isatty():
        rich_table(header, cells, right, out)
    else:
        for line in plain_table(header, cells, right):
            out.write(line + "\n")


def emit_raw(rows: list[dict], keys: list[str], fmt: str, out) -> None:
    """Rows already holding raw values, as a JSON array, CSV or newline-delimited JSON."""
    # One write of one string: json.dump would make a write call per token.
    if fmt == "json":
        out.write(json.dumps(rows, indent=2) + "\n")
    elif fmt == "nl":
        out.write("".join(json.dumps(r) + "\n" for r in rows))
    else:
        # "\n", not csv's default "\r\n": the output goes to pipes and Unix tools.
        w = csv.writer(out, lineterminator="\n")
        w.writerow(keys)
        for r in rows:
            w.writerow(["" if r[k] is None else r[k] for k in keys])


def plain_table(header: list[str], cells: list[list[str]], right: list[bool], indent: str = "") -> list[str]:
    """An aligned text table (tabulate's "simple" style): header, dashes, rows.

    Hand-written rather than tabulate or rich: it is a dozen lines, needs no import and
    its output is stable for tests and for `grep`.
    """
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(header)]

    def line(values: list[str]) -> str:
        parts = [v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)]
        return (indent + "  ".join(parts)).rstrip()

    return [line(header), line(["-" * w for w in widths])] + [line(row) for row in cells]


# rich lays a Table out at about 1 ms a row here: beyond this many rows a terminal gets the
# plain table, which prints 10,000 runs in a blink instead of ten seconds.
RICH_MAX_ROWS = 300
STATE_STYLES = {
    "failed": "red",
    "succeeded": "green",
    "running": "cyan",
    "cancelled": "yellow",
    "pending": "dim",
    "skipped": "dim",
}


def console(file=None):
    """A rich Console that never splits a line it prints when its output is not a terminal: piped
    into a file or `tee`, a printed command ("eyas --home … logs 1 --stage train") must stay one
    line that can be copied and run (rich wraps at 80 columns where it knows no width)."""
    import sys

    from rich.console import Console

    stream = file if file is not None else sys.stdout
    return Console(file=file, soft_wrap=not (hasattr(stream, "isatty") and stream.isatty()))


def rich_table(header: list[str], cells: list[list[str]], right: list[bool], out) -> None:
    if len(cells) > RICH_MAX_ROWS:
        for line in plain_table(header, cells, right):
            out.write(line + "\n")
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, header_style="bold", pad_edge=False)
    for h, r in zip(header, right):
        table.add_column(h, justify="right" if r else "left", no_wrap=True)
    # Text, not markup strings: a run named "[x]" must print as it is.
    styles = [STATE_STYLES if h == "state" else {} for h in header]
    for row in cells:
        table.add_row(*(Text(v, style=st.get(v, "")) for v, st in zip(row, styles)))
    console = Console(file=out)
    # Never truncate a cell to fit the terminal: let a wide row wrap instead, as `ps` does.
    natural = sum(max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)) + 2 * len(header)
    console.width = max(console.width, natural)
    console.print(table, highlight=False)
