"""What a log view shows, row by row: one rank's lines, or all ranks merged by time.

A model answers two questions only, both cheap whatever the size of the logs: how many
rows there are, and which rows are at [start, start + count). The merged view never
builds a merged index of every line: each rank's log is already in time order, so the row
at position N is found by a k-way selection (binary searches by time over the ranks'
line indexes, reading a few dozen lines), and neighbouring rows by stepping a k-way merge
forward or backward. Opening a merged view of 8 million lines costs milliseconds.
"""

from __future__ import annotations

from typing import NamedTuple

from .logindex import LogFile
from .logsearch import Scan


class Row(NamedTuple):
    rank: int
    line: int  # line number in the rank's file, from 0
    text: str


class Source:
    """One rank's lines in a view: all of them, or those a filter scan kept."""

    def __init__(self, file: LogFile, scan: Scan | None = None):
        self.file = file
        self.scan = scan
        self.rank = file.rank

    def count(self) -> int:
        return self.scan.count() if self.scan is not None else self.file.line_count()

    def line_no(self, i: int) -> int:
        return self.scan.matches[i] if self.scan is not None else i

    def index_of(self, line: int) -> int:
        """The index in this source of the first kept line at or after `line`."""
        return self.scan.row_of(line) if self.scan is not None else line

    def key(self, i: int) -> tuple[str, int, int]:
        line = self.line_no(i)
        return (self.file.stamp(line), self.rank, line)

    def texts(self, indexes: list[int]) -> list[str]:
        """Texts of the kept lines at `indexes` (ascending), reading runs of adjacent lines at once."""
        lines = [self.line_no(i) for i in indexes]
        out: list[str] = []
        run_start = 0
        for k in range(1, len(lines) + 1):
            if k == len(lines) or lines[k] != lines[k - 1] + 1:
                out += self.file.lines(lines[run_start], lines[k - 1] + 1)
                run_start = k
        # A line that vanished (a truncated file) still needs its row.
        return out + [""] * (len(lines) - len(out))


class SingleModel:
    """One rank's log (filtered or not): row i is the source's i-th line."""

    merged = False

    def __init__(self, source: Source):
        self.sources = [source]
        self.source = source

    def total(self) -> int:
        return self.source.count()

    def rows(self, start: int, count: int) -> list[Row]:
        end = min(start + count, self.total())
        if start >= end:
            return []
        idx = list(range(start, end))
        texts = self.source.texts(idx)
        return [Row(self.source.rank, self.source.line_no(i), t) for i, t in zip(idx, texts)]

    def row_of(self, rank: int, line: int) -> int:
        return self.source.index_of(line)


class MergedModel:
    """Several ranks' logs as one, ordered by (time, rank, line): rows found by selection."""

    merged = True

    def __init__(self, sources: list[Source]):
        self.sources = list(sources)
        self._cache: tuple[int, list[int]] | None = None  # (row, cut) of the last answer

    def total(self) -> int:
        return sum(s.count() for s in self.sources)

    # -- positions ------------------------------------------------------------------------

    def _cut_for(self, row: int, counts: list[int]) -> list[int]:
        """Per source, how many of its lines come before merged row `row`."""
        total = sum(counts)
        row = max(0, min(row, total))
        if self._cache is not None:
            at, cut = self._cache
            if abs(row - at) <= 2000 and all(c <= n for c, n in zip(cut, counts)):
                return self._step(list(cut), row - at, counts)
        if total - row <= 2000:
            return self._step(list(counts), row - total, counts)
        return self.select(row, counts)

    def _head(self, cut: list[int], counts: list[int]) -> int | None:
        """The source whose next line comes first after `cut`."""
        best, best_key = None, None
        for s, (c, n) in enumerate(zip(cut, counts)):
            if c < n:
                k = self.sources[s].key(c)
                if best_key is None or k < best_key:
                    best, best_key = s, k
        return best

    def _tail(self, cut: list[int]) -> int | None:
        """The source whose line just before `cut` comes last."""
        best, best_key = None, None
        for s, c in enumerate(cut):
            if c > 0:
                k = self.sources[s].key(c - 1)
                if best_key is None or k > best_key:
                    best, best_key = s, k
        return best

    def _step(self, cut: list[int], delta: int, counts: list[int]) -> list[int]:
        while delta > 0:
            s = self._head(cut, counts)
            if s is None:
                break
            cut[s] += 1
            delta -= 1
        while delta < 0:
            s = self._tail(cut)
            if s is None:
                break
            cut[s] -= 1
            delta += 1
        return cut

    def select(self, row: int, counts: list[int] | None = None) -> list[int]:
        """The cut before merged row `row`: a k-way selection by binary search on keys.

        Invariant: lo <= answer <= hi per source. Each round halves the widest range,
        pivoting on its middle key and counting, per source, the keys below the pivot.
        """
        counts = counts if counts is not None else [s.count() for s in self.sources]
        lo = [0] * len(counts)
        hi = list(counts)
        small = max(64, 4 * len(counts))
        while True:
            need = row - sum(lo)
            if need <= 0:
                return lo
            if sum(hi) <= row:
                return hi
            widths = [h - low for h, low in zip(hi, lo)]
            if sum(widths) <= small:
                return self._step(lo, need, hi)
            r = max(range(len(widths)), key=widths.__getitem__)
            mid = (lo[r] + hi[r]) // 2
            pivot = self.sources[r].key(mid)
            cut = [mid if s == r else self._count_below(s, pivot, lo[s], hi[s]) for s in range(len(counts))]
            if sum(cut) <= row:
                lo = cut
            else:
                hi = cut

    def _count_below(self, s: int, pivot: tuple, lo: int, hi: int) -> int:
        """How many of source s's lines in [0, hi) have a key below `pivot` (at least lo)."""
        src = self.sources[s]
        while lo < hi:
            mid = (lo + hi) // 2
            if src.key(mid) < pivot:
                lo = mid + 1
            else:
                hi = mid
        return lo

    # -- rows -----------------------------------------------------------------------------

    def rows(self, start: int, count: int) -> list[Row]:
        counts = [s.count() for s in self.sources]
        cut = self._cut_for(start, counts)
        self._cache = (start, list(cut))
        picks: list[tuple[int, int]] = []  # (source, index) in merged order
        for _ in range(count):
            s = self._head(cut, counts)
            if s is None:
                break
            picks.append((s, cut[s]))
            cut[s] += 1
        by_source: dict[int, list[int]] = {}
        for s, i in picks:
            by_source.setdefault(s, []).append(i)
        texts = {s: dict(zip(idx, self.sources[s].texts(idx))) for s, idx in by_source.items()}
        return [Row(self.sources[s].rank, self.sources[s].line_no(i), texts[s][i]) for s, i in picks]

    def row_of(self, rank: int, line: int) -> int:
        """The merged row of a rank's line (or of the first kept line after it)."""
        src_i = next(i for i, s in enumerate(self.sources) if s.rank == rank)
        src = self.sources[src_i]
        i = src.index_of(line)
        if i >= src.count():
            return self.total()
        pivot = src.key(i)
        return sum(
            i if s == src_i else self._count_below(s, pivot, 0, self.sources[s].count())
            for s in range(len(self.sources))
        )
