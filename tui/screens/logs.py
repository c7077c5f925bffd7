"""The Logs screen: one rank's log or all ranks merged by time, followed live.

The files are read straight from the attempt directory (the ranks write them; the daemon
never pipes them), indexed by a LogWatcher thread, and drawn by a LogView that renders only
the visible rows. The screen polls the watcher on a timer, so however fast lines arrive the
view redraws at most REDRAW_HZ times a second. An empty view says why (`_empty_text`): the rank
has not written yet, or no line matches the filter.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Input, Static

from eyas.state import contract

from .. import format as fmt
from ..history import attempt_dir, pick_stage
from ..live import Changes
from ..logindex import LogFile
from ..logmodel import MergedModel, SingleModel, Source
from ..logsearch import ERROR_RE, Scan, compile_filter
from ..logwatch import LogWatcher
from ..widgets.logview import LogView
from .base import EyasScreen

REDRAW_HZ = 10


class LogsScreen(EyasScreen):
    DEFAULT_CSS = """
    LogsScreen #head { height: 1; padding: 0 1; }
    LogsScreen #status { height: 1; padding: 0 1; background: $panel; }
    LogsScreen #filter { display: none; }
    LogsScreen #filter.shown { display: block; }
    """
    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("f", "follow", "Follow"),
        Binding("slash", "filter", "Filter"),
        Binding("m", "filter_mode", "Filter/highlight"),
        Binding("e", "first_error", "First error"),
        Binding("w", "wrap", "Wrap"),
        Binding("a", "merged", "All ranks"),
        Binding("t", "stacks", "Stacks"),
        Binding("left_square_bracket", "rank_step(-1)", "Prev rank"),
        Binding("right_square_bracket", "rank_step(1)", "Next rank"),
        *[Binding(str(n), f"rank({n})", f"Rank {n}", show=False) for n in range(10)],
    ]

    def __init__(
        self,
        run_id: int,
        stage: str | None = None,
        attempt: int | None = None,
        rank: int | None = 0,
        merged: bool = False,
        jump_error: bool = False,
    ) -> None:
        super().__init__()
        self.run_id = run_id
        self.stage_name = stage
        self.pinned = attempt is not None  # else follow the stage's newest attempt
        self.attempt_no = attempt
        self.rank = rank if rank is not None else 0
        self.merged = merged
        self.filter_text = ""
        self.pattern: re.Pattern | None = None
        self.mode = "filter"  # or "highlight": every line, matches marked
        self.files: dict[int, LogFile] = {}
        self.watcher: LogWatcher | None = None
        self.opened_at: float | None = None
        self._scans: dict[tuple[int, str], Scan] = {}
        self._error_scans: dict[int, Scan] | None = None
        self._jump_error = jump_error
        self._seen = -1
        self._generations: dict[LogFile, int] = {}  # each log's generation as last told (_tell_cuts)
        self._ready = False
        self._status_text = ""
        self.dir: Path | None = None

    def title_text(self) -> str:
        return f"run {self.run_id} › logs"

    def compose_body(self) -> ComposeResult:
        yield Static("", id="head")
        yield LogView(id="log")
        yield Input(placeholder="regex; enter applies, escape clears", id="filter")
        yield Static("", id="status")

    def on_mount(self) -> None:
        self.opened_at = time.perf_counter()
        self._open_attempt()
        self.set_interval(1 / REDRAW_HZ, self._tick)
        self.query_one(LogView).focus()

    def on_unmount(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()

    # -- the attempt and its files --------------------------------------------------------

    def _open_attempt(self) -> None:
        run = self.app.history.run(self.run_id)
        view = self.query_one(LogView)
        stage = pick_stage(run, self.stage_name) if run else None
        attempts = stage["attempt_list"] if stage else []
        if not attempts:
            what = f"stage {self.stage_name}" if self.stage_name else "any stage"
            view.set_model(None, f"run {self.run_id}: {what} has not started yet, so there are no logs")
            return
        self.stage_name = stage["name"]
        attempt = next((a for a in attempts if a["number"] == self.attempt_no), attempts[-1])
        self.attempt_no = attempt["number"]
        self.dir = attempt_dir(attempt, self.app.history.home)
        t = time.localtime(attempt["started_at"] or self.app.history.clock())
        start = (t.tm_year, t.tm_mon, t.tm_mday)
        # Every rank's file, even one not written yet; other rows (TP workers that log
        # through their driver) only when they have a file of their own.
        ranks = set(range(attempt["world_size"] or 0)) | {
            r["rank"] for r in attempt["ranks"] if (self.dir / contract.rank_file(r["rank"], contract.LOG)).exists()
        }
        try:
            ranks |= {r for p in self.dir.iterdir() if (r := contract.rank_of_log(p.name)) is not None}
        except OSError:
            pass
        if self.watcher is not None:
            self.watcher.stop()
        self.files = {r: LogFile(self.dir / contract.rank_file(r, contract.LOG), r, start) for r in sorted(ranks)}
        if self.rank not in self.files and self.files:
            self.rank = min(self.files)
        self._scans.clear()
        self._error_scans = None
        loop = asyncio.get_running_loop()
        # The first paint should not wait for the next timer tick once the log is indexed.
        self.watcher = LogWatcher(list(self.files.values()), on_ready=lambda: loop.call_soon_threadsafe(self._tick))
        self._ready = False
        self._apply()
        self.watcher.start()
        if self._jump_error:
            self._jump_error = False
            self.action_first_error()

    def _shown_files(self) -> list[LogFile]:
        if self.merged:
            return list(self.files.values())
        return [self.files[self.rank]] if self.rank in self.files else []

    def _scan(self, f: LogFile) -> Scan | None:
        if self.pattern is None or self.mode != "filter":
            return None
        key = (f.rank, self.pattern.pattern)
        if key not in self._scans:
            self._scans[key] = Scan(f, self.pattern)
        return self._scans[key]

    def _apply(self) -> None:
        """Build the model for the current rank, view and filter."""
        view = self.query_one(LogView)
        shown = self._shown_files()
        if self.watcher is None or not shown:
            view.set_model(None, "no log files in this attempt")
            return
        sources = [Source(f, self._scan(f)) for f in shown]
        scans = [s.scan for s in sources if s.scan is not None]
        if self._error_scans:
            scans += list(self._error_scans.values())
        self.watcher.set_scans(scans)
        self.watcher.set_focus(shown)
        self.watcher.want_stamps = self.merged
        self._model = MergedModel(sources) if self.merged else SingleModel(sources[0])
        view.pattern = self.pattern
        self._ready = False
        self._seen = -1
        view.set_model(None, self._indexing_text())
        self._header()
        self._tick()

    def _indexing_text(self) -> str:
        shown = self._shown_files()
        done = sum(f.progress() for f in shown) / max(1, len(shown))
        what = "all ranks" if self.merged else f"rank {self.rank}"
        return f"indexing {what}… {done:.0%}"

    # -- the timer: bounded redraws ---------------------------------------------------------------

    def _tick(self) -> None:
        w = self.watcher
        if w is None or not self.is_mounted:
            return
        view = self.query_one(LogView)
        if w.error is not None:
            view.set_model(None, f"reading the logs failed: {w.error}")
            return
        if not self._ready:
            if all(f.caught_up for f in self._shown_files()):
                self._ready = True
                view.set_model(self._model)
            else:
                view.placeholder = self._indexing_text()
                view.refresh()
                return
        if w.version != self._seen:
            self._seen = w.version
            view.sync()
            self._tell_cuts()
        if view.model is not None and not view.model.total():
            empty = self._empty_text()
            if empty != view.placeholder:
                view.placeholder = empty
                view.sync()
        self._status()
        if self._error_scans is not None and all(s.done for s in self._error_scans.values()):
            self._finish_error_jump()

    def _empty_text(self) -> str:
        """Why the view shows no line."""
        shown = self._shown_files()
        if (
            self.pattern is not None
            and self.mode == "filter"
            and any(f.path.exists() and f.path.stat().st_size for f in shown)
        ):
            return f"no line matches /{self.filter_text}/ (yet); escape clears the filter"
        if self.merged:
            return f"no rank of {self.stage_name} attempt {self.attempt_no} has written its log yet"
        f = shown[0] if shown else None
        if f is None or not f.path.exists():
            name = f.path.name if f is not None else f"rank-{self.rank}.log"
            return f"rank {self.rank} has not written its log yet ({name} does not exist yet)"
        return f"rank {self.rank} has written nothing to its log yet ({f.path.name} is empty)"

    def _tell_cuts(self) -> None:
        """Say when a shown log was cut at its bound (or replaced): the lines the view held
        moved, and the marker line in the log says what was dropped."""
        for f in self._shown_files():
            seen = self._generations.setdefault(f, f.generation)
            if f.generation != seen:
                self._generations[f] = f.generation
                self.notify(
                    f"{f.path.name} was cut at its bound (log_max_mb): its middle was dropped; "
                    'the line "eyas: ··· cut … bytes here" marks where',
                    severity="warning",
                )

    def _header(self) -> None:
        head = Text.assemble((f"{self.stage_name} attempt {self.attempt_no}", "bold"), "  ")
        ranks = sorted(self.files)
        if len(ranks) <= 16:
            head.append("rank ")
            for r in ranks:
                on = r == self.rank and not self.merged
                head.append(f" {r} ", style=("reverse " if on else "") + fmt.rank_style(r))
            head.append("  ")
            head.append(" all ", style="reverse bold" if self.merged else "dim")
        else:
            head.append("all ranks" if self.merged else f"rank {self.rank} of {len(ranks)}")
        head.append("   [ ] 0-9 a", style="dim")
        self.query_one("#head", Static).update(head)
        self.set_title(f"run {self.run_id} › {self.stage_name} › logs")

    def _status(self) -> None:
        """The line under the log; redrawn only when what it says changed."""
        view = self.query_one(LogView)
        model = view.model
        total = model.total() if model is not None else 0
        height = view.scrollable_content_region.height
        # Following, the view shows the last rows whatever the scroll offset says.
        top = max(0, total - height) if view.follow else min(int(view.scroll_offset.y), max(0, total - 1))
        bits = ["all ranks by time" if self.merged else f"rank {self.rank}"]
        if total:
            last = min(total, top + height)
            bits.append(f"{top + 1:,}–{last:,} of {total:,}")
        else:
            bits.append("empty")
        bits.append("FOLLOWING" if view.follow else "paused (f follows)")
        if self.pattern is not None:
            if self.mode == "filter":
                scans = [s for s in (self._scans.get((f.rank, self.pattern.pattern)) for f in self._shown_files()) if s]
                pending = "" if all(s.done for s in scans) else " (scanning…)"
                bits.append(f"filter /{self.filter_text}/{pending}")
            else:
                bits.append(f"highlight /{self.filter_text}/")
        bits.append("wrap" if view.wrap else "no wrap")
        text = "  ·  ".join(bits)
        if text != self._status_text:
            self._status_text = text
            self.query_one("#status", Static).update(text)

    def on_live(self, changes: Changes) -> None:
        if self.pinned or not (changes.overflow or self.run_id in changes.runs):
            return
        run = self.app.history.run(self.run_id)
        stage = pick_stage(run, self.stage_name) if run else None
        if (
            stage
            and stage["attempt_list"]
            and (self.attempt_no is None or stage["attempt_list"][-1]["number"] > self.attempt_no)
        ):
            self.attempt_no = None
            self._open_attempt()
            self.notify(f"{self.stage_name}: following attempt {self.attempt_no}")

    # -- actions ----------------------------------------------------------------------------------

    def action_back(self) -> None:
        box = self.query_one("#filter", Input)
        if box.has_class("shown") or self.pattern is not None:
            self._clear_filter()
            return
        self.app.pop_screen()

    def action_follow(self) -> None:
        view = self.query_one(LogView)
        view.follow = True
        self._status()

    def action_stacks(self) -> None:
        """For a hang: every live rank writes its Python stacks into its log, which this view follows."""
        self.query_one(LogView).follow = True
        self._status()
        self.run_worker(self.control("stacks", run=self.run_id, stage=self.stage_name, native=False), group="control")

    def action_wrap(self) -> None:
        view = self.query_one(LogView)
        view.wrap = not view.wrap
        self._status()

    def action_rank(self, n: int) -> None:
        if n in self.files:
            self.rank, self.merged = n, False
            self.query_one(LogView).follow = True
            self._apply()

    def action_rank_step(self, step: int) -> None:
        ranks = sorted(self.files)
        if not ranks:
            return
        i = ranks.index(self.rank) if self.rank in ranks else 0
        self.action_rank(ranks[(i + step) % len(ranks)])

    def action_merged(self) -> None:
        self.merged = not self.merged
        self.query_one(LogView).follow = True
        self._apply()

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("shown")
        box.value = self.filter_text
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value
        try:
            pattern = compile_filter(text) if text else None
        except ValueError as exc:
            self.notify(str(exc), severity="error")
            return
        event.input.remove_class("shown")
        self.filter_text, self.pattern = text, pattern
        self.query_one(LogView).focus()
        self._apply()

    def _clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.remove_class("shown")
        box.value = ""
        self.filter_text, self.pattern = "", None
        self.query_one(LogView).focus()
        self._apply()

    def action_filter_mode(self) -> None:
        self.mode = "highlight" if self.mode == "filter" else "filter"
        self.notify(
            f"{self.mode}: " + ("only matching lines" if self.mode == "filter" else "every line, matches marked")
        )
        self._apply()

    def action_first_error(self) -> None:
        if self.watcher is None:
            return
        self._error_scans = {f.rank: Scan(f, ERROR_RE, first_only=True) for f in self._shown_files()}
        self.watcher.set_scans([s for s in self.watcher.scans if not s.first_only] + list(self._error_scans.values()))

    def _finish_error_jump(self) -> None:
        found = {rank: s.first for rank, s in self._error_scans.items() if s.first is not None}
        self._error_scans = None
        self.watcher.set_scans([s for s in self.watcher.scans if not s.first_only])
        if not found:
            what = "any rank's log" if self.merged else f"rank {self.rank}'s log"
            self.notify(f"No error line in {what}.", severity="warning")
            return
        rank, line = min(found.items(), key=lambda kv: self.files[kv[0]].stamp(kv[1]) if self.merged else 0)
        view = self.query_one(LogView)
        if view.model is None:
            view.set_model(self._model)
            self._ready = True
        view.goto(view.model.row_of(rank, line), mark=(rank, line))
        self._status()
