"""The Run screen: the stage pipeline, the selected stage's progress, and the controls.

The screen follows the run: the stage shown is the one running now, and it moves on with the
run, until the user picks a stage (moving onto it in the table, or enter); `f` follows the run
again. What the run is doing now is derived from its stage, attempt and rank rows, never from
the newest event's text; quiet or partly exited ranks are named (state/liveness.py), and a
rank's long silent phase (a load, an engine start, a wait) is said in place of an ETA
(queries.phase_text). A streaming run's two running stages are both named, and its window is
drawn under the stages as `eyas show` writes it (queries.window_lines)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import DataTable, ProgressBar, Static

from eyas.state import display, liveness, queries

from .. import format as fmt
from ..history import pick_stage
from ..live import Changes
from ..widgets.modals import SubmitScreen
from ..widgets.pipeline import Pipeline
from ..widgets.stagecurves import StageCurves
from ..widgets.stagetable import StageTable
from .base import EyasScreen

# (key, label, width, priority); the reason column takes what is left of the width.
STAGE_COLUMNS = [
    ("name", "stage", 9, 0),
    ("state", "state", 11, 0),
    ("attempt", "att", 3, 0),
    ("restarts", "rst", 3, 2),
    ("duration", "duration", 8, 0),
    ("tok_s", "tok/s", 7, 0),
    ("peak", "peak GPU", 9, 1),
    ("reason", "reason", 6, 3),
]


class RunScreen(EyasScreen):
    DEFAULT_CSS = """
    RunScreen #summary { height: auto; padding: 0 1; }
    RunScreen Pipeline { margin: 1 0 0 0; }
    RunScreen #stages { height: auto; max-height: 12; }
    RunScreen #window { height: auto; padding: 0 1; display: none; }
    RunScreen #progress { height: auto; padding: 0 1; }
    RunScreen #bar Bar { width: 1fr; }
    RunScreen #bar { width: 1fr; }
    RunScreen #cause { height: auto; max-height: 3; padding: 0 1; margin: 1 0 0 0; color: $error; }
    """
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("f", "follow", "Follow run"),
        Binding("r", "ranks", "Ranks"),
        Binding("l", "logs", "Logs"),
        Binding("e", "errors", "Errors"),
        Binding("m", "metrics", "Metrics"),
        Binding("s", "stop_stage", "Stop stage"),
        Binding("S", "stop_run", "Stop run"),
        Binding("R", "retry", "Retry"),
        Binding("k", "skip", "Skip"),
        Binding("u", "resume", "Resume"),
        Binding("n", "submit", "Submit"),
    ]

    def __init__(self, run_id: int, *, stage: str | None = None, curves: bool = True) -> None:
        super().__init__()
        self.run_id = run_id
        self.curves = curves  # the curves panel (tests/bench/bench_curves.py opens the screen without it)
        self.run: dict | None = None
        self.stage_name: str | None = None
        self.picked: str | None = stage  # the stage the user chose; None: follow the run
        self._columns: list[tuple[str, str, int]] = []

    def title_text(self) -> str:
        return f"run {self.run_id}"

    def compose_body(self) -> ComposeResult:
        yield Static("", id="summary")
        yield Pipeline(id="pipeline")
        yield StageTable(id="stages", cursor_type="row")
        yield Static("", id="window")
        with Vertical(id="progress"):
            yield ProgressBar(total=1.0, show_eta=False, id="bar")
            yield Static("", id="figures")
        yield Static("", id="cause")
        if self.curves:
            yield StageCurves(id="curves")

    def on_mount(self) -> None:
        self.reload()
        self.set_interval(1.0, self._tick)
        self.query_one(DataTable).focus()

    # -- data ---------------------------------------------------------------------------------

    def reload(self) -> None:
        run = self.app.history.run(self.run_id)
        if run is None:
            self.query_one("#summary", Static).update(f"No run {self.run_id} in the store.")
            return
        self.run = run
        names = [s["name"] for s in run["stages"]]
        if self.picked is not None and self.picked in names:
            self.stage_name = self.picked
        else:
            # Following: the stage running now, else the last that ran (pick_stage).
            chosen = pick_stage(run)
            self.stage_name = chosen["name"] if chosen else None
        self._fill()

    def _tick(self) -> None:
        if self.run is not None and self.run["state"] == "running":
            self.reload()

    def on_live(self, changes: Changes) -> None:
        if changes.overflow or self.run_id in changes.runs:
            self.reload()
        elif self.run_id in changes.metrics:
            self._show_progress()

    @property
    def stage(self) -> dict | None:
        if self.run is None:
            return None
        return next((s for s in self.run["stages"] if s["name"] == self.stage_name), None)

    def _fill(self) -> None:
        run = self.run
        self.set_title(f"run {run['id']} · {run['name']}")
        summary = Text.assemble(
            (f"run {run['id']} ", "bold"),
            (run["name"] or "", "bold"),
            "  ",
            fmt.badge(run["state"]),
            f"  ·  {run['model'] or 'no model'}  ·  started {display.local_minute(run['started_at'] or run['created_at'])}"
            f"  ·  {display.duration(run['duration']) or '–'}",
        )
        status, style = self._status(run)
        if status:
            summary.append(f"\n{status}", style=style)
        self.query_one("#summary", Static).update(summary)
        self.query_one(Pipeline).show(run["stages"], self.stage_name)
        self.refresh_bindings()
        table = self.query_one("#stages", DataTable)
        self._fit(table)
        keys = [s["name"] for s in run["stages"]]
        if [str(k.value) for k in table.rows] != keys:
            table.clear()
            for s in run["stages"]:
                table.add_row(*self._cells(s), key=s["name"])
        else:
            for s in run["stages"]:
                for (col, _, _), cell in zip(self._columns, self._cells(s)):
                    table.update_cell(s["name"], col, cell)
        if self.stage_name in keys and table.cursor_row != keys.index(self.stage_name):
            table.move_cursor(row=keys.index(self.stage_name))
        self._show_window()
        self._show_progress()
        self._show_cause()
        self._show_curves()

    def _show_window(self) -> None:
        """A streaming run's window; hidden for any other run, whose layout stays as it was."""
        lines = queries.window_lines(self.run.get("window") if self.run else None)
        window = self.query_one("#window", Static)
        window.display = bool(lines)
        window.update(Text("\n".join(lines), style="dim") if lines else "")

    def on_resize(self) -> None:
        if self.run is not None:
            self._fill()

    def _fit(self, table: DataTable) -> None:
        width = (self.size.width or 80) - 2
        columns = fmt.fit_columns(STAGE_COLUMNS, width)
        spare = width - sum(w + 2 for _, _, w in columns)
        columns = [(k, label, w + max(0, spare) if k == "reason" else w) for k, label, w in columns]
        if columns != self._columns:
            self._columns = columns
            table.clear(columns=True)
            for key, label, w in columns:
                table.add_column(label, key=key, width=w)

    def _ranks(self, s: dict) -> list[dict]:
        """The ranks of the stage's latest attempt, each last write as fresh as the events have it."""
        if not s["attempt_list"]:
            return []
        a = s["attempt_list"][-1]
        return self.app.live.with_writes(self.run_id, s["name"], a["number"], a["ranks"])

    def _note(self, s: dict) -> str:
        """Quiet or partly exited ranks of the stage's running attempt; "" when all is well."""
        if s["state"] != "running" or not s["attempt_list"] or s["attempt_list"][-1]["state"] != "running":
            return ""
        return liveness.stage_note(self._ranks(s), self.app.history.clock(), liveness.quiet_after())

    def _status(self, run: dict) -> tuple[str, str]:
        """The line under the run's name: what it is doing now, from the rows of its current
        stage (a run's stored reason is the event that last moved it, stale once a stage
        runs). A failure's reason is left out: the root cause below says it."""
        if run["state"] == "failed":
            return "", ""
        if run["state"] != "running":
            return run["reason"] or "", "dim"
        running = [s for s in run["stages"] if s["state"] == "running"]
        if not running:
            # Between two stages, or held back: the scheduler's "waiting for devices" is
            # current (it is written each time it holds the run back); nothing else is.
            nxt = next((s for s in run["stages"] if s["state"] == "pending"), None)
            why = run["reason"] if (run["reason"] or "").startswith("waiting") else ""
            return (f"{nxt['name']} pending" if nxt else "") + (f": {why}" if why and nxt else why), "dim"
        # A streaming run's extract and train run at once: each is named, in pipeline order, with
        # what it waits for (the figures below are the shown stage's only).
        found = [self._stage_status(s, phase=len(running) > 1) for s in running]
        style = "bold yellow" if any(warn for _, warn in found) else "dim"
        return "  ·  ".join(text for text, _ in found), style

    def _stage_status(self, stage: dict, phase: bool = False) -> tuple[str, bool]:
        """What one running stage is doing (with `phase`, its open phase too), and whether its
        ranks call for attention."""
        a = stage["attempt_list"][-1] if stage["attempt_list"] else None
        if a is None:
            return f"{stage['name']} starting", False
        if a["state"] != "running":
            return f"{stage['name']} running: attempt {a['number']} {a['state']}, the next one is due", False
        text = f"{stage['name']} running · attempt {a['number']} · {display.duration(a['duration'])}"
        if phase and (what := self._phase(stage)):
            text += f" · {what}"
        note = self._note(stage)
        return (f"{text} · {note}", True) if note else (text, False)

    def _cells(self, s: dict) -> list:
        live = self.app.live.stage.get((self.run_id, s["name"]), {}) if s["state"] == "running" else {}
        toks = None if s["name"] in queries.NO_RATE_STAGES else live.get("tok_s", s["tok_s"])
        note = self._note(s)
        cells = {
            "name": s["name"],
            "state": fmt.badge(s["state"]),
            "attempt": str(s["attempts"] or "–"),
            "restarts": str(s["restarts"] or 0),
            "duration": display.duration(s["duration"]),
            "tok_s": display.count(toks),
            "peak": display.size(s["peak_gpu_mem"]),
            "reason": Text(note, style="bold yellow") if note else Text(s["reason"] or "", style="dim"),
        }
        return [cells[k] for k, _, _ in self._columns]

    def _show_progress(self) -> None:
        s = self.stage
        bar = self.query_one("#bar", ProgressBar)
        figures = self.query_one("#figures", Static)
        if s is None:
            figures.update("")
            return
        attempt = s["attempts"] or 0
        live = self.app.live.stage.get((self.run_id, s["name"])) if s["state"] == "running" else None
        hist = self.app.history
        if live is not None:
            progress, eta, toks = live.get("progress"), live.get("eta_s"), live.get("tok_s")
        elif attempt:
            progress = 1.0 if s["state"] == "succeeded" else hist.latest(self.run_id, s["name"], attempt, "progress")
            eta = (
                0.0
                if s["state"] == "succeeded"
                else (hist.latest(self.run_id, s["name"], attempt, "eta_s") if s["state"] == "running" else None)
            )
            toks = s["tok_s"]
        else:
            progress, eta, toks = None, None, None
        bar.update(progress=progress or 0.0)
        bits = [f"{s['name']} {s['state']}"]
        phase = self._phase(s)
        unsaid = s["state"] == "running" and not phase and eta is None and not progress
        if s["state"] == "running":
            # What the stage waits for, where an ETA would say "–": its ranks' open phase, quiet
            # ranks, or that none has reported progress yet (imports, reading its inputs).
            bits.append(phase or self._waiting(s, progress) or ("no progress reported yet" if unsaid else fmt.eta(eta)))
        if s["name"] in queries.NO_RATE_STAGES:
            pass  # a check stage's tokens are no throughput
        elif toks if phase or unsaid else (toks is not None or s["state"] == "running"):
            bits.append(fmt.rate(toks))
        for name, label in (("loss", "loss"), ("acc_0", "acc")):
            value = self.app.live.last_any_rank(self.run_id, s["name"], attempt, name) if live is not None else None
            if value is None and attempt:
                value = hist.latest(self.run_id, s["name"], attempt, name)
            if value is not None:
                bits.append(f"{label} {value:.4g}")
        bits += self._evaluate_bits(s, attempt, live is not None)
        if self.picked is not None:
            bits.append("picked (f follows the run)")
        figures.update("  ·  ".join(bits))

    def _phase(self, s: dict) -> str:
        """What the stage's running attempt waits for, from its ranks' open phases; "" when no
        rank is in one (or the daemon has not said)."""
        if s["state"] != "running" or not s["attempt_list"]:
            return ""
        phases = self.app.live.phase(self.run_id, s["name"], s["attempt_list"][-1]["number"])
        return queries.phase_text(phases, self.app.history.clock())

    def _waiting(self, s: dict, progress: float | None) -> str:
        """`waiting` in place of an ETA when nothing moves: every running rank quiet, or all
        the work counted while the stage still runs (an ETA of 0 s would say it is ending)."""
        if not s["attempt_list"]:
            return ""
        if s["attempt_list"][-1]["state"] != "running":
            return "waiting for the next attempt"
        idle = liveness.stage_idle(self._ranks(s), self.app.history.clock())
        if idle is not None and idle >= liveness.quiet_after():
            return f"waiting: no rank wrote for {liveness.ago(idle)}"
        if progress is not None and progress >= 1.0:
            return "waiting: all work counted, the stage still runs"
        return ""

    def _evaluate_bits(self, s: dict, attempt: int, live: bool) -> list[str]:
        """The evaluate stage's figures: the trained draft's acceptance beside its untrained
        baseline's, and tok/s with and without the draft. From the stored summary once the stage
        succeeded, else from its progress metrics as each measurement ends."""
        if s["name"] != "evaluate" or not attempt:
            return []
        summary = s.get("summary") if isinstance(s.get("summary"), dict) else {}
        if "acceptance_length" in summary:
            rates = "/".join(f"{r:.2f}" for r in summary.get("per_position") or [])
            base = summary["baseline_acceptance_length"]
            accept = f"{summary['acceptance_length']:.2f}" + _span(
                summary.get("acceptance_length_lo"), summary.get("acceptance_length_hi")
            )
            gain = (
                f", gain {summary['gain']:.2f}{_span(summary.get('gain_lo'), summary.get('gain_hi'))}"
                if isinstance(summary.get("gain"), (int, float))
                else ""
            )
            on = f" on {summary['prompts']} prompts" if isinstance(summary.get("prompts"), int) else ""
            bits = [
                f"accept {accept} (untrained {base:.2f}){gain}{on}",
                f"per position {rates}",
                f"{display.count(summary['draft_tok_s'])} tok/s with the draft, {display.count(summary['target_tok_s'])} "
                "without",
            ]
            return bits + ["lossless" if summary.get("lossless") else "NOT lossless"]
        bits = []

        def latest(name: str) -> float | None:
            value = self.app.live.last_any_rank(self.run_id, s["name"], attempt, name) if live else None
            return self.app.history.latest(self.run_id, s["name"], attempt, name) if value is None else value

        for name, label in (("accept_len", "accept"), ("baseline_accept_len", "untrained"), ("gain", "gain")):
            value = latest(name)
            if value is not None:
                bits.append(f"{label} {value:.2f}" + _span(latest(f"{name}_lo"), latest(f"{name}_hi")))
        return bits

    def _show_cause(self) -> None:
        s = self.stage
        cause = self.query_one("#cause", Static)
        root = s["attempt_list"][-1]["root_cause"] if s and s["attempt_list"] else None
        if root is None:
            cause.update("")
            return
        msg = (root["message"] or "").strip().splitlines()
        msg = f": {msg[0][:120]}" if msg else " (empty message)"
        cause.update(
            f"Root cause of {s['name']} attempt {s['attempt_list'][-1]['number']}: rank {root['rank']} "
            f"{root['type']}{msg}   (e: errors)"
        )

    def _show_curves(self) -> None:
        if self.curves:
            self.query_one(StageCurves).show(self.run, self.stage_name)

    def on_stage_table_picked(self, event: StageTable.Picked) -> None:
        """The user chose a stage: it stays shown, whatever the run does, until `f`."""
        self.picked = event.stage
        if event.stage != self.stage_name:
            self.stage_name = event.stage
            if self.run is not None:
                self.query_one(Pipeline).show(self.run["stages"], self.stage_name)
                self._show_cause()
                self._show_curves()
        self._show_progress()
        self.refresh_bindings()

    def action_follow(self) -> None:
        """`f`: follow the run again, from the stage running now."""
        self.picked = None
        self.reload()
        self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Controls that cannot apply now are shown dimmed (None); --readonly hides them."""
        allowed = super().check_action(action, parameters)
        if not allowed or self.run is None:
            return allowed
        stage, run_state = self.stage, self.run["state"]
        state = stage["state"] if stage else None
        applies = {
            "follow": self.picked is not None,  # dimmed while the screen follows the run
            "stop_stage": state in ("running", "pending") and run_state in ("pending", "running"),
            "stop_run": run_state in ("pending", "running"),
            "retry": state in ("failed", "cancelled"),
            "skip": state in ("pending", "failed", "cancelled"),
            "resume": run_state in ("failed", "cancelled"),
        }.get(action, True)
        return True if applies else None

    # -- views --------------------------------------------------------------------------------

    def action_ranks(self) -> None:
        from .ranks import RanksScreen

        if self.stage_name:
            self.app.push_screen(RanksScreen(self.run_id, self.stage_name))

    def action_logs(self) -> None:
        from .logs import LogsScreen

        if self.stage_name:
            self.app.push_screen(LogsScreen(self.run_id, self.stage_name))

    def action_errors(self) -> None:
        from .errors import ErrorsScreen

        self.app.push_screen(ErrorsScreen(self.run_id))

    def action_metrics(self) -> None:
        from .metrics import MetricsScreen

        self.app.push_screen(MetricsScreen([self.run_id], self.stage_name))

    # -- controls -----------------------------------------------------------------------------

    def action_stop_stage(self) -> None:
        if self.stage_name:
            self.run_worker(
                self.control(
                    "stop",
                    f"Stop stage {self.stage_name} of run {self.run_id}?",
                    "Its ranks get SIGTERM, then SIGKILL after the grace period; the run is cancelled.",
                    run=self.run_id,
                    stage=self.stage_name,
                ),
                group="control",
            )

    def action_stop_run(self) -> None:
        self.run_worker(
            self.control(
                "stop",
                f"Stop run {self.run_id}?",
                "The running stage is torn down and the run cancelled.",
                run=self.run_id,
            ),
            group="control",
        )

    def action_retry(self) -> None:
        if self.stage_name:
            self.run_worker(self.control("retry", run=self.run_id, stage=self.stage_name), group="control")

    def action_skip(self) -> None:
        if self.stage_name:
            self.run_worker(
                self.control(
                    "skip",
                    f"Skip stage {self.stage_name} of run {self.run_id}?",
                    "The run continues without its outputs.",
                    run=self.run_id,
                    stage=self.stage_name,
                ),
                group="control",
            )

    def action_resume(self) -> None:
        self.run_worker(self.control("resume", run=self.run_id), group="control")

    def action_submit(self) -> None:
        if self.refuse_control():
            return
        self.app.push_screen(
            SubmitScreen(self.run["config_path"] if self.run else ""),
            lambda result: result and self.notify(f"Run {result['run_id']} submitted"),
        )


def _span(lo, hi) -> str:
    """` [lo, hi]`, an evaluate figure's 95 % interval; nothing without one (older summaries)."""
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)):
        return f" [{lo:.2f}, {hi:.2f}]"
    return ""
