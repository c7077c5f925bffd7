"""`eyas submit --follow` and the demo: one run's progress until it ends, as live bars on a terminal and as plain lines anywhere else.

On a terminal, rich's live bars, one per stage. Anywhere else (a pipe, a file, a CI log), where
rich's live display writes nothing until it stops: one timestamped line per stage change as it
happens, and a progress line per running stage when what it says changed (its progress, or the
phase it waits in), looked at every EVERY_S seconds (`EYAS_FOLLOW_EVERY` overrides it), and at
least every QUIET_S seconds while nothing changes. A rank's long silent phase (a load, an engine
start, a wait: its heartbeats, which the daemon's "metric" events carry) is said in place of the
progress and the ETA. Either way, an attempt that fails is told root cause first, as the store has it
(daemon/failures.py chose and ordered the records), its rank named as the TUI names it (`rank 2
(TP worker 1)`, state/display.rank_label), then the attempt's other failures. The signals eyas
sent while tearing the group down are no failure and are never printed: the daemon records
those ranks as `killed`, and only their own failures become error records.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from eyas.cli import output
from eyas.state import display, paths, queries
from eyas.state.display import duration as human_duration
from eyas.wire.client import Client

TERMINAL_RUN = ("succeeded", "failed", "cancelled")
DONE_STAGE = ("succeeded", "skipped")
# Seconds between two looks at a running stage's progress when the output is not a terminal.
EVERY_S = 10.0
# Seconds a plain follow stays silent about a stage whose progress and phase do not change (at
# least QUIET_TICKS looks): a line now and then says the follow is alive.
QUIET_S = 60.0
QUIET_TICKS = 6


def _snapshot(run_id: int) -> dict:
    db = queries.connect(paths.db_path())
    try:
        return queries.get_run(db, run_id)
    finally:
        db.close()


def failure_lines(run_id: int, stage: str) -> list[str]:
    """The stage's newest failed attempt, root cause first, then its other failures (one line
    each), read from the store once the settlement that ordered them has committed."""
    from .history import error_title

    db = queries.connect(paths.db_path())
    try:
        rows = queries.errors(db, run_id, stage)
    finally:
        db.close()
    if not rows:
        return [f"{stage}: failed with no error recorded"]
    newest = (rows[0]["stage"], rows[0]["attempt"])
    lines = []
    for e in (r for r in rows if (r["stage"], r["attempt"]) == newest):
        what = "root cause" if e["root_cause"] else "also failed"
        title = (error_title(e).splitlines() or [""])[0]
        lines.append(f"{stage} attempt {e['attempt']} {what}: {display.rank_label(e)}: {title}")
    return lines


class Stages:
    """What the follow knows of each stage: its state, progress and the figures shown beside it."""

    def __init__(self, stages: list[dict]):
        self.state = {s["name"]: s["state"] for s in stages}
        self.progress = {s["name"]: 1.0 if s["state"] in DONE_STAGE else 0.0 for s in stages}
        self.info = {s["name"]: s["state"] for s in stages}
        self.reason = {s["name"]: s.get("reason") for s in stages}
        self.since = {s["name"]: time.monotonic() for s in stages}
        self.phases: dict[str, dict] = {}  # each running stage's ranks' open phases, as last sent
        self.figures: dict[str, str] = {}  # each running stage's figures (tok/s, loss, ETA...)
        self._shown: dict[str, dict] = {}  # the latest loss, accuracy and validation loss of each stage

    def moved(self, stage: str, to: str) -> None:
        if to != self.state.get(stage):
            self.since[stage] = time.monotonic()
        self.state[stage] = to
        self.info[stage] = to
        self.phases.pop(stage, None)
        self.figures.pop(stage, None)
        if to in DONE_STAGE:
            self.progress[stage] = 1.0

    def metric(self, d: dict) -> None:
        """A metric event: the stage's progress and its line of figures."""
        stage = d["stage"]
        live = d.get("live") or {}
        if isinstance(d.get("phases"), dict):  # a daemon from before phases sends none
            self.phases[stage] = d["phases"]
        waiting = self.waiting(stage)
        bits = []
        if live.get("tok_s") and stage not in queries.NO_RATE_STAGES:
            bits.append(f"{live['tok_s']:,.0f} tok/s")
        latest = {s["name"]: s["value"] for s in d.get("samples", [])}
        shown = self._shown.setdefault(stage, {})
        if "loss" in latest:
            shown.update(loss=latest["loss"], acc=latest.get("acc_0"))
        if "val_loss" in latest:
            shown["val"] = latest["val_loss"]
        for key in ("accept_len", "baseline_accept_len", "gain"):
            for name in (key, f"{key}_lo", f"{key}_hi"):
                if name in latest:
                    shown[name] = latest[name]
        for key, label in (
            ("loss", "loss {:.4f}"),
            ("acc", "acc₀ {:.2f}"),
            ("val", "val {:.4f}"),
            ("accept_len", "accept {:.2f}"),
            ("baseline_accept_len", "untrained {:.2f}"),
            ("gain", "gain {:.2f}"),
        ):
            if shown.get(key) is not None:
                bits.append(label.format(shown[key]) + _span(shown.get(f"{key}_lo"), shown.get(f"{key}_hi")))
        if live.get("eta_s") is not None and not waiting:
            bits.append(f"ETA {human_duration(live['eta_s'])}")
        self.progress[stage] = float(live.get("progress") or 0.0)
        self.figures[stage] = " · ".join(bits)
        self.info[stage] = "running " + " · ".join(([waiting] if waiting else []) + bits)

    def waiting(self, stage: str) -> str:
        """What the stage's ranks wait for now (queries.phase_text), "" when no phase is open."""
        return queries.phase_text(self.phases.get(stage), time.time())

    def line(self, stage: str) -> tuple[tuple, str]:
        """A running stage's plain progress line, and what must change for the next to say
        something new: its progress (in whole percent) and the phase it waits in (each rank's
        phase and its start)."""
        waiting = self.waiting(stage)  # says for how long itself
        figures = self.figures.get(stage, "")
        done = f"{self.progress[stage]:.0%}"
        if waiting:
            head = f"{done} · {waiting}" if self.progress[stage] > 0 else waiting
        else:
            head = f"{done} after {human_duration(time.monotonic() - self.since[stage])}"
        phases = self.phases.get(stage) or {}
        key = (f"{self.progress[stage]:.0%}", sorted((r, p.get("phase"), p.get("since")) for r, p in phases.items()))
        return key, f"{stage}: {head}" + (f" · {figures}" if figures else "")


class LiveView:
    """rich's live bars, for a terminal."""

    def __init__(self, console, stages: Stages):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.stages = stages
        self.bars = Progress(
            TextColumn("{task.description:<10}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.tasks = {
            name: self.bars.add_task(name, total=1.0, completed=stages.progress[name], info=stages.info[name])
            for name in stages.state
        }

    def __enter__(self):
        self.bars.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bars.__exit__(*exc)

    def update(self, stage: str) -> None:
        self.bars.update(self.tasks[stage], completed=self.stages.progress[stage], info=self.stages.info[stage])

    def moved(self, stage: str, to: str, reason: str) -> None:
        self.update(stage)

    def failed(self, lines: list[str]) -> None:
        for line in lines:
            self.bars.console.print(line, style="red", markup=False, highlight=False)


class PlainView:
    """Plain lines, for a pipe or a file: stage changes as they come, and each running stage's
    progress every `every` seconds from a thread of its own (a silent phase sends no event, and
    a steady line says the follow is alive)."""

    def __init__(self, out, stages: Stages, every: float):
        self.out, self.stages, self.every = out, stages, every
        self.quiet = max(QUIET_S, QUIET_TICKS * every)
        self._said: dict[str, tuple[tuple, float]] = {}  # stage -> (the last line's key, when)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="follow-progress", daemon=True)

    def __enter__(self):
        # Where the run stands as the follow begins (a stage may have started before it).
        for stage, state in self.stages.state.items():
            if state != "pending":
                self.moved(stage, state, self.stages.reason.get(stage) or "")
        self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._ticker.join(timeout=5)

    def write(self, line: str) -> None:
        with self._lock:
            self.out.write(f"{time.strftime('%H:%M:%S')} {line}\n")
            self.out.flush()

    def update(self, stage: str) -> None:
        """Progress waits for the next tick."""

    def moved(self, stage: str, to: str, reason: str) -> None:
        self._said.pop(stage, None)  # the next look says where the stage stands now
        self.write(f"{stage}: {to}" + (f" ({reason})" if reason else ""))

    def failed(self, lines: list[str]) -> None:
        for line in lines:
            self.write(line)

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            for stage, state in list(self.stages.state.items()):
                if state != "running":
                    continue
                key, line = self.stages.line(stage)
                said = self._said.get(stage)
                now = time.monotonic()
                if said is not None and said[0] == key and now - said[1] < self.quiet:
                    continue  # nothing new: the same "0%" again would only fill the log
                self._said[stage] = (key, now)
                self.write(line)


def _every() -> float:
    try:
        return max(0.1, float(os.environ.get("EYAS_FOLLOW_EVERY") or EVERY_S))
    except ValueError:
        return EVERY_S


def follow(run_id: int, console=None) -> int:
    """Follow the run until it ends, then print its summary; 0 if it succeeded."""
    console = console or output.console()
    client = Client(timeout=None)
    events = client.subscribe(["state", "metric"], run=run_id)
    run = _snapshot(run_id)
    stages = Stages(run["stages"])
    if console.is_terminal:
        view = LiveView(console, stages)
    else:
        view = PlainView(console.file or sys.stdout, stages, _every())
    final = run["state"] if run["state"] in TERMINAL_RUN else None
    try:
        with view:
            for ev in [] if final else events:
                d = ev.data
                if ev.event == "state":
                    entity, to, reason = d.get("entity"), d.get("to_state"), d.get("reason") or ""
                    if entity == "stage" and d.get("stage") in stages.state:
                        stage = d["stage"]
                        restart = to == "running" and reason.startswith("restart ")
                        if to == "failed" or restart:
                            # The root cause first; the daemon's own summary of it follows only
                            # as far as it says what happens next (a restart and its delay).
                            view.failed(failure_lines(run_id, stage))
                            reason = reason.split(" after ", 1)[0] if restart else ""
                        stages.moved(stage, to)
                        view.moved(stage, to, reason)
                    elif entity == "attempt" and d.get("stage") in stages.state and to == "running":
                        # A restart's attempt starts with no stage event (the stage stayed
                        # running); the first attempt's start is the stage's own line.
                        if (d.get("attempt") or 1) > 1:
                            stages.moved(d["stage"], "running")
                            stages.since[d["stage"]] = time.monotonic()
                            view.moved(d["stage"], "running", reason)
                    if entity == "run" and to in TERMINAL_RUN:
                        final = to
                        break
                elif ev.event == "metric" and d.get("stage") in stages.state:
                    stages.metric(d)
                    view.update(d["stage"])
    finally:
        client.close()
    run = _snapshot(run_id)
    summary(run, console)
    return 0 if run["state"] == "succeeded" else 1


def summary(run: dict, console) -> None:
    """The run's table (one row per stage: state, attempts, duration, tok/s, what it made), its
    root causes, and each stage's output paths."""
    from rich.table import Table

    table = Table(title=f"run {run['id']} {run['name']}: {run['state']}")
    for col in ("stage", "state", "attempts", "duration", "tok/s", "result"):
        table.add_column(col)
    for s in run["stages"]:
        table.add_row(
            s["name"],
            s["state"],
            str(s["attempts"]),
            human_duration(s["duration"]),
            f"{s['tok_s']:,.0f}" if s["tok_s"] else "",
            result(s["name"], s.get("summary")),
        )
    console.print(table)
    for s in run["stages"]:
        for a in s["attempt_list"]:
            rc = a["root_cause"]
            if rc and a is s["attempt_list"][-1]:
                console.print(
                    f"{s['name']} attempt {a['number']}: {display.rank_label(rc)} {rc['type']}"
                    f"{': ' + rc['message'] if rc['message'] else ''}",
                    style="red",
                    markup=False,
                    highlight=False,
                    soft_wrap=True,  # one line in a pipe too, for grep
                )
    for s in run["stages"]:
        outputs = (s.get("summary") or {}).get("outputs") or []
        if outputs:
            console.print(f"{s['name']:<8} -> {', '.join(outputs)}", highlight=False, soft_wrap=True)
    if run.get("output_dir"):
        console.print(f"outputs: {run['output_dir']}", highlight=False, soft_wrap=True)


def _num(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "?"


def _span(lo, hi) -> str:
    """` [lo, hi]`, an interval after its figure; nothing without one (older summaries)."""
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)):
        return f" [{lo:.2f}, {hi:.2f}]"
    return ""


def result(stage: str, s: dict | None) -> str:
    """One line of what a stage made, from its summary.json (known stages; else nothing)."""
    if not s:
        return ""
    if stage == "prepare" and "rows_out" in s:
        return f"{s['rows_out']} rows, {s.get('tokens', 0):,} tokens, {s.get('skipped_total', 0)} skipped"
    if stage == "regenerate" and "rows_out" in s:
        # What the later stages train on now: the target's own answers (and what cut them short).
        parts = [
            f"{s['rows_out']} of {_num(s.get('rows'), 'd')} rows answered by the target",
            f"{_num(s.get('turns'), 'd')} turns",
            f"{_num(s.get('tokens_generated'), ',d')} tokens",
        ]
        for key, what in (
            ("rows_cut_max_tokens", "with a turn cut at max_tokens"),
            ("rows_cut_max_length", "cut at max_length"),
            ("rows_failed", "failed"),
        ):
            if s.get(key):
                parts.append(f"{s[key]} {what}")
        return ", ".join(parts)
    if stage == "extract" and "samples" in s:
        return f"{s['samples']} samples, layers {s.get('layer_ids')}"
    if stage == "vocab" and "draft_vocab_size" in s:
        return (
            f"{s['draft_vocab_size']} of {s.get('target_vocab_size')} tokens, coverage {_num(s.get('coverage'), '.0%')}"
        )
    if stage == "train" and "val_loss" in s:
        accs = "/".join(_num(s[f"val_acc_{k}"], ".2f") for k in range(16) if f"val_acc_{k}" in s)
        return (
            f"loss {_num(s.get('loss'), '.4f')}, val {_num(s.get('val_loss'), '.4f')} "
            f"(from {_num(s.get('val_loss_initial'), '.4f')}), val acc {accs}"
        )
    if stage == "evaluate" and "acceptance_length" in s:
        rates = "/".join(_num(r, ".2f") for r in s.get("per_position") or [])
        base = _num(s.get("baseline_acceptance_length"), ".2f")
        accept = _num(s["acceptance_length"], ".2f") + _span(
            s.get("acceptance_length_lo"), s.get("acceptance_length_hi")
        )
        gain = f", gain {_num(s['gain'], '.2f')}{_span(s.get('gain_lo'), s.get('gain_hi'))}" if "gain" in s else ""
        return (
            f"accept {accept} (untrained {base}){gain}, per position {rates}, "
            f"{_num(s.get('draft_tok_s'), ',.0f')} tok/s ({_num(s.get('target_tok_s'), ',.0f')} without), "
            f"{'lossless' if s.get('lossless') else 'NOT lossless'}"
        )
    return ""
