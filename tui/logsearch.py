"""Regex scans over indexed logs: the lines a filter keeps, and the first error line.

A scan advances a few MB at a time (from the watcher thread) and keeps the numbers of the
matching lines in an array, so a filter over a million-line log costs 8 bytes per match
and shows its first matches while the rest is still being read.
"""

from __future__ import annotations

import array
import bisect
import re

from .logindex import CHUNK, LogFile

# What counts as an error line for "jump to the first error": a Python traceback, a logged
# error, or a native crash dump (faulthandler).
ERROR_RE = re.compile(
    r"Traceback \(most recent call last\)|\b(?:ERROR|CRITICAL|FATAL)\b|Fatal Python error|"
    r"^\w+(?:\.\w+)*(?:Error|Exception): "
)


def compile_filter(text: str) -> re.Pattern:
    """The user's filter as a regex, or ValueError naming the problem and the fix."""
    try:
        return re.compile(text, re.MULTILINE)
    except re.error as exc:
        raise ValueError(
            f"filter {text!r} is not a regular expression ({exc}); escape special characters with a backslash"
        ) from None


class Scan:
    """The lines of one LogFile that match `pattern`, found incrementally."""

    def __init__(self, file: LogFile, pattern: re.Pattern, first_only: bool = False):
        self.file = file
        self.pattern = pattern
        self.first_only = first_only
        self.matches = array.array("Q")
        self.scanned = 0  # complete lines examined
        self.generation = file.generation

    @property
    def done(self) -> bool:
        """True when every complete line so far was examined (or, with first_only, one matched)."""
        return (self.first_only and bool(self.matches)) or self.scanned >= self.file.complete_count()

    @property
    def first(self) -> int | None:
        return self.matches[0] if self.matches else None

    def count(self) -> int:
        return len(self.matches)

    def step(self, max_bytes: int = CHUNK) -> bool:
        """Examine up to about `max_bytes` more; True when something was examined."""
        f = self.file
        if f.generation != self.generation:
            self.matches = array.array("Q")
            self.scanned = 0
            self.generation = f.generation
        if self.done:
            return False
        lo = self.scanned
        hi = f.complete_count()
        start, end = f.span(lo, hi)
        if end - start > max_bytes:
            # As many whole lines as fit in max_bytes (at least one).
            hi = max(lo + 1, f.line_at_offset(start + max_bytes))
            start, end = f.span(lo, hi)
        texts = f.lines(lo, hi)
        found = self._search("\n".join(texts), lo)
        if self.first_only and found:
            found = found[:1]
        self.matches.extend(found)
        self.scanned = hi
        return True

    def _search(self, text: str, line: int) -> list[int]:
        """Numbers of the lines of `text` (first line = `line`) where the pattern matches.

        One search over the joined block, not one per line: the regex engine skips the
        non-matching lines at C speed, and the Python loop runs once per matching line.
        """
        found = []
        pos = 0
        search, count, find = self.pattern.search, text.count, text.find
        while True:
            m = search(text, pos)
            if m is None:
                return found
            line += count("\n", pos, m.start())
            found.append(line)
            nl = find("\n", m.start())
            if nl < 0:
                return found
            pos = nl + 1
            line += 1

    def row_of(self, line: int) -> int:
        """The row in the filtered view of the first match at or after `line`."""
        return bisect.bisect_left(self.matches, line)
