"""`eyas logs`: a rank's log, or all ranks merged by time, read from the attempt directory.

The daemon never pipes rank output (each rank writes `rank-<r>.log` itself), so this reads
the files directly and works with the daemon down. Files are streamed line by line and
merged lazily (heapq.merge), so a log of many GiB costs no memory. A log cut at its bound
while followed (state/logcut.py) is followed on from its marker line. Without --stage, the stage
chosen is named on stderr (stdout stays the log's lines).
"""

from __future__ import annotations

import heapq
import re
import sys
import time
from pathlib import Path

from eyas.state import contract, paths, queries
from eyas.state.logcut import Tail
from eyas.state.logtime import HEAD as _HEAD
from eyas.state.logtime import TIME as _TIME
from eyas.state.logtime import from_match as _from_match
from eyas.state.logtime import stamp as _stamp

from . import history

POLL_S = 0.2
# After the attempt has ended, how long the files must stay unchanged before -f stops.
QUIET_S = 2.0


def line_time(line: str, start: tuple[int, int, int]) -> str | None:
    """The local time a log line carries, as a sortable `YYYY-MM-DD HH:MM:SS.ffffff`, or None.

    vLLM omits the year: it is the year of `start` (the attempt's local year, month, day),
    or the next one for a month-day before the start (an attempt that ran over New Year).
    """
    year, month, day = start
    return _stamp(line, str(year), f"{month:02d}-{day:02d}")


class RankLog:
    """One rank's log file, read incrementally: a line without a time inherits the previous
    line's time in this file (as Toolong does); lines before any time sort first."""

    def __init__(self, path: Path, rank: int, start: tuple[int, int, int]):
        self.path, self.rank = path, rank
        self.year, self.monthday = str(start[0]), f"{start[1]:02d}-{start[2]:02d}"
        self.tail = Tail(path)
        self.time = ""
        self.lineno = 0

    def read(self, final: bool):
        """Yield ((time, rank, line number), text) for each complete line available now.

        With `final`, a last line without its newline is yielded too; otherwise it is kept
        until the writer finishes it. Iterating the file again after its end reads what was
        appended since, which is what -f relies on. (The loop is written out flat: it runs
        once per log line, millions of times for a long training run.)
        """
        rank, year, monthday, search, head = self.rank, self.year, self.monthday, _TIME.search, _HEAD
        t, n = self.time, self.lineno
        chunks = self._chunks(final)
        try:
            for chunk in chunks:
                text = chunk[:-1] if chunk[-1:] == "\n" else chunk
                if text[-1:] == "\r":
                    text = text[:-1]
                m = search(text, 0, head)
                if m is not None:
                    t = _from_match(m, year, monthday)
                n += 1
                yield (t, rank, n), text
        finally:
            self.time, self.lineno = t, n

    def _chunks(self, final: bool):
        """The file's new lines. The Tail hands over complete lines only (or a huge line's
        pieces), and after a cut at the log's bound goes on from the marker line, which is
        thus printed. Split on "\n" only: a progress bar's "\r" stays inside its line."""
        while data := self.tail.read(final):
            lines = data.decode("utf-8", "replace").split("\n")
            last = lines.pop()
            for line in lines:
                yield line + "\n"
            if last:
                yield last

    def close(self) -> None:
        self.tail.close()


class Failure(Exception):
    """A one-line error for stderr, and its exit code."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def command(args) -> int:
    try:
        pattern = _pattern(args.grep)
        db, run = history._load(args.run)
        if run is None:
            print(f"eyas: no run {args.run}", file=sys.stderr)
            return 1
        stage = _stage(run, args.stage)
        attempt = _attempt(run, stage, args.attempt)
        note = _chosen(run, stage) if not args.stage and len(run["stages"]) > 1 else None
        return Follower(db, run, stage, attempt, args, pattern).run(note)
    except Failure as exc:
        print(f"eyas logs: {exc}", file=sys.stderr)
        return exc.code


def _pattern(text: str | None):
    if text is None:
        return None
    try:
        return re.compile(text)
    except re.error as exc:
        raise Failure(f"--grep {text!r}: not a regular expression ({exc}); escape special characters", 2) from None


def _stage(run: dict, wanted: str | None) -> dict:
    """The stage asked for; by default the run's current stage, else the last one that ran."""
    stages = run["stages"]
    if wanted:
        for s in stages:
            if s["name"] == wanted:
                return s
        names = ", ".join(s["name"] for s in stages)
        raise Failure(f"run {run['id']} has no stage {wanted!r} (its stages: {names})")
    for s in stages:
        if s["name"] == run["stage"] and s["attempt_list"]:
            return s
    ran = [s for s in stages if s["attempt_list"]]
    if not ran:
        raise Failure(f"run {run['id']} has not started a stage yet, so it has no logs")
    return ran[-1]


def _chosen(run: dict, stage: dict) -> str:
    """Which stage `eyas logs RUN` shows, and why, when the user named none."""
    why = {"running": "the stage running now", "failed": "the stage that failed"}.get(
        stage["state"], "the last stage that ran"
    )
    others = ", ".join(s["name"] for s in run["stages"] if s["name"] != stage["name"])
    return f"showing {stage['name']}, {why}; --stage NAME for another ({others})"


def _attempt(run: dict, stage: dict, number: int | None) -> dict:
    attempts = stage["attempt_list"]
    if not attempts:
        raise Failure(f"stage {stage['name']} of run {run['id']} has not started yet, so it has no logs")
    if number is None:
        return attempts[-1]
    for a in attempts:
        if a["number"] == number:
            return a
    have = ", ".join(str(a["number"]) for a in attempts)
    raise Failure(f"stage {stage['name']} of run {run['id']} has no attempt {number} (its attempts: {have})")


def _attempt_dir(attempt: dict) -> Path:
    d = Path(attempt["dir"])
    return d if d.is_absolute() else paths.state_dir() / d


class Follower:
    """Prints one attempt's logs, then (with -f) what is appended, switching to newer attempts."""

    def __init__(self, db, run: dict, stage: dict, attempt: dict, args, pattern):
        self.db, self.run_id, self.stage = db, run["id"], stage["name"]
        self.args, self.pattern = args, pattern
        self.pinned = args.attempt is not None
        self.logs: dict[int, RankLog] = {}
        self._use(attempt)

    def _use(self, attempt: dict) -> None:
        for log in self.logs.values():
            log.close()
        self.logs = {}
        self.number = attempt["number"]
        self.dir = _attempt_dir(attempt)
        t = time.localtime(attempt.get("started_at") or time.time())
        self.start = (t.tm_year, t.tm_mon, t.tm_mday)

    def _discover(self) -> bool:
        """Open rank logs not opened yet; True when one was."""
        found = False
        try:
            names = [p.name for p in self.dir.iterdir()]
        except FileNotFoundError:
            return False
        for name in names:
            rank = contract.rank_of_log(name)
            if rank is None:
                continue
            if rank in self.logs or (self.args.rank is not None and rank != self.args.rank):
                continue
            self.logs[rank] = RankLog(self.dir / name, rank, self.start)
            found = True
        # Keep rank order: it breaks ties between equal times.
        self.logs = dict(sorted(self.logs.items()))
        return found

    def _write(self, entries) -> int:
        """Print entries (key, text); returns how many there were before --grep."""
        n = 0
        prefix = self.args.rank is None
        search = self.pattern.search if self.pattern is not None else None
        buf: list[str] = []
        for (_, rank, _), text in entries:
            n += 1
            if search is not None and not search(text):
                continue
            buf.append(f"[r{rank}] {text}\n" if prefix else text + "\n")
            if len(buf) >= 1024:  # a write per line costs more than the parsing
                sys.stdout.write("".join(buf))
                buf.clear()
        sys.stdout.write("".join(buf))
        return n

    def run(self, note: str | None = None) -> int:
        """Print the logs (and with -f, follow them); `note`, which stage this is when the user
        named none, goes to stderr first."""
        self._discover()
        if not self.logs and not self.args.follow:
            what = f"rank {self.args.rank}" if self.args.rank is not None else "any rank"
            raise Failure(f"no log for {what} in {self.dir} ({self.stage} attempt {self.number})")
        if note:
            print(f"eyas logs: {note}", file=sys.stderr, flush=True)
        final = not self.args.follow
        self._write(heapq.merge(*(log.read(final) for log in self.logs.values())))
        if self.args.follow:
            sys.stdout.flush()
            self._follow()
        return 0

    def _follow(self) -> None:
        quiet_since = time.monotonic()
        while True:
            time.sleep(POLL_S)
            self._discover()
            batch = []
            for log in self.logs.values():
                batch.extend(log.read(final=False))
            if self._write(sorted(batch)):
                sys.stdout.flush()
                quiet_since = time.monotonic()
            attempts = queries.stage_attempts(self.db, self.run_id, self.stage)
            latest = attempts[-1] if attempts else None
            if not self.pinned and latest and latest["number"] > self.number:
                self._flush_partials()
                self._use(latest)
                sys.stdout.write(f"--- {self.stage} attempt {self.number} started; following it ---\n")
                sys.stdout.flush()
                quiet_since = time.monotonic()
                continue
            if time.monotonic() - quiet_since < QUIET_S:
                continue
            mine = next((a for a in attempts if a["number"] == self.number), None)
            if mine is None or mine["state"] == "running":
                continue
            # A stage still running or pending may yet start another attempt to follow.
            if not self.pinned and queries.stage_state(self.db, self.run_id, self.stage) in ("running", "pending"):
                continue
            self._flush_partials()
            return

    def _flush_partials(self) -> None:
        """Print what the writers left without a final newline."""
        self._write(sorted(e for log in self.logs.values() for e in log.read(final=True)))
        sys.stdout.flush()
