"""Split a vLLM driver rank's combined log into one log per tensor-parallel worker.

vLLM's worker processes inherit the driver's stdout and stderr, so everything the engine's
processes say lands in the driver's `rank-<r>.log`, each line prefixed by vLLM with the
process that wrote it: `(Worker_TP1 pid=7)`, `(Worker pid=7)` (TP=1, or before the TP groups
exist), `(VllmWorker-1 pid=7)` (before vLLM names the process), `(EngineCore pid=6)`,
`(MainProcess pid=5)`; older vLLM wrote `(VllmWorker rank=1 pid=7)`; any of them may be
wrapped in colour codes. eyas's worker extension prefixes a worker's plain prints the same
way (`(Worker_TP<k> pid=<p>)`).

The daemon reads the driver's log (it never writes it: the processes do, so the raw log is
complete even while the daemon is down) and appends each line to exactly one of
- `tp-<k>.log`: the lines of TP worker k, known by its pid (from its tp-<k>.proc.json) or,
  failing that, by the TP rank in its prefix;
- `driver.log`: everything else: the driver's own lines, EngineCore's (the engine's
  scheduler runs in the driver rank's process tree, and is sampled with it), and unprefixed
  lines, whoever wrote them (C-level output of a worker carries no prefix).
Lines are copied verbatim, prefix included, so the union of the split files is the raw log.

Restart-safe and exactly-once: `rank-<r>.split.json` records how far the raw log was read
and how long each output was then; it is written (atomically) after the outputs. A daemon
that died in between truncates the outputs back to the recorded sizes and reads on from
the recorded offset, so no line is lost or doubled.

Bounded as the raw log is: when the driver's monitor cuts the raw log at its bound
(state/logcut.py), reading goes on from the cut, whose marker line lands in `driver.log`;
each split log is cut at the same bound by the daemon, their only writer.

It also picks up vLLM's own word on a worker's death, which only vLLM can know (the
worker's parent, EngineCore, reaps it): `Worker proc VllmWorker-1 died unexpectedly (exit
code: -9)`, or `(exit code: None)` when vLLM looked before reaping it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from eyas.state import contract, logcut

_ANSI = rb"(?:\x1b\[[0-9;]*m)*"
PREFIX = re.compile(
    _ANSI + rb"\((?P<name>[A-Za-z][\w.-]*(?: (?:rank=\d+|[A-Z]+\d+(?:_[A-Z]+\d+)*))?) pid=(?P<pid>\d+)\)"
)
_TP_IN_NAME = re.compile(rb"(?:^|_| )TP(\d+)(?:_|$)")
_RANK_IN_NAME = re.compile(rb"^VllmWorker(?:-| rank=)(\d+)$")
# vLLM logs proc.exitcode, which is None when its monitor thread wakes before the process is
# reaped: a death is then known, its status not.
DIED = re.compile(rb"Worker proc VllmWorker-(\d+) died unexpectedly \(exit code: (-?\d+|None)\)")
DRIVER = "driver"
CHUNK = 8 << 20  # bytes read per pump: a flood is split over passes, never stalls the daemon


def route(line: bytes, tp_of_pid: Callable[[int], int | None]) -> int | str:
    """The TP rank whose log takes `line`, or DRIVER."""
    m = PREFIX.match(line)
    if m is None:
        return DRIVER
    name = m.group("name")
    if not (name.startswith(b"Worker") or name.startswith(b"VllmWorker")):
        return DRIVER
    tp = tp_of_pid(int(m.group("pid")))
    if tp is not None:
        return tp
    for pattern in (_TP_IN_NAME, _RANK_IN_NAME):
        found = pattern.search(name)
        if found:
            return int(found.group(1))
    return DRIVER


def output_name(target: int | str) -> str:
    return contract.DRIVER_LOG if target == DRIVER else contract.tp_file(target, contract.LOG)


class LogSplitter:
    """Reads `source` from where it stopped; `pump()` once per supervision pass."""

    def __init__(self, source: Path, state_path: Path):
        self.source = Path(source)
        self.dir = self.source.parent
        self.state_path = Path(state_path)
        self.sizes: dict[str, int] = {}
        self.died: dict[int, int | None] = {}  # TP rank -> exit code as vLLM reported it (None: unknown)
        self.bounds: dict[str, logcut.Bound] = {}
        self._cut: dict | None = None  # the raw log's bound (its cut.json), read once
        self.tail = logcut.Tail(self.source, self._load())

    @property
    def offset(self) -> int:
        """How far the raw log is routed: the Tail's place, which also follows a cut."""
        return self.tail.offset

    def _load(self) -> int:
        """Take up the recorded state; returns the raw log's offset to go on from."""
        try:
            state = json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            state = {}
        self.sizes = {str(k): int(v) for k, v in (state.get("sizes") or {}).items()}
        self.died = {int(k): (None if v is None else int(v)) for k, v in (state.get("died") or {}).items()}
        # Lines appended after the last recorded state are appended again: cut them first.
        for path in self.dir.glob(contract.TP_LOG_GLOB):
            self._truncate(path, self.sizes.get(path.name, 0))
        self._truncate(self.dir / contract.DRIVER_LOG, self.sizes.get(contract.DRIVER_LOG, 0))
        return int(state.get("offset", 0))

    @staticmethod
    def _truncate(path: Path, size: int) -> None:
        try:
            if path.stat().st_size > size:
                os.truncate(path, size)
        except FileNotFoundError:
            pass

    def pump(self, tp_of_pid: Callable[[int], int | None], final: bool = False) -> list[tuple[int, int | None]]:
        """Route the complete lines appended since the last pump (with `final`, a last
        line without its newline too). Returns the worker deaths vLLM reported in them."""
        died: list[tuple[int, int | None]] = []
        while chunk := self.tail.read(final, CHUNK):
            died += self._route(chunk, tp_of_pid)
            self._save()
            if not final:
                break  # one chunk per pass
        return died

    def _route(self, data: bytes, tp_of_pid) -> list[tuple[int, int | None]]:
        out: dict[str, list[bytes]] = {}
        died = []
        # Split on "\n" only: a "\r" (a progress bar's redraw) stays inside its line.
        pieces = data.split(b"\n")
        lines = [p + b"\n" for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])
        for line in lines:
            target = route(line, tp_of_pid)
            out.setdefault(output_name(target), []).append(line)
            if target == DRIVER and b"died unexpectedly" in line:
                m = DIED.search(line)
                if m:
                    tp, code = int(m.group(1)), (None if m.group(2) == b"None" else int(m.group(2)))
                    self.died[tp] = code
                    died.append((tp, code))
        for name, lines in out.items():
            blob = b"".join(lines)
            self._bound(name, len(blob))
            with open(self.dir / name, "ab") as f:
                f.write(blob)
                self.sizes[name] = f.tell()  # the file's size, after a cut too
        return died

    def _bound(self, name: str, coming: int) -> None:
        """Cut a split log that `coming` bytes would take past the bound the driver's monitor
        applies to the raw log (it records it in the raw log's cut.json at start). The daemon
        is these files' only writer, so it cuts before it appends and keeps the newest lines."""
        bound = self.bounds.get(name)
        if bound is None:
            if self._cut is None:  # the monitor wrote it at start, long before TP workers appear
                self._cut = logcut.read_cut(self.source)
            if not self._cut.get("max_bytes"):
                return
            bound = self.bounds[name] = logcut.Bound(
                self.dir / name, self._cut["max_bytes"], self._cut.get("setting", "")
            )
        bound.check(coming)
        bound.close()

    def _save(self) -> None:
        tmp = self.state_path.with_name(f".{self.state_path.name}.{os.getpid()}.tmp")
        tmp.write_text(
            json.dumps(
                {
                    "source": self.source.name,
                    "offset": self.offset,
                    "sizes": self.sizes,
                    "died": {str(k): v for k, v in self.died.items()},
                }
            )
        )
        os.replace(tmp, self.state_path)
