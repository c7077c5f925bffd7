"""The Errors screen: the root cause first, in full, then the other failures collapsed.

Errors come newest attempt first, its root cause first (queries.errors). The traceback is
syntax-highlighted; `c` copies it through the terminal's clipboard escape (OSC 52, which
works over SSH), and `l` opens the failing rank's log at its first error line. A run without
errors says why there are none (empty_text).
"""

from __future__ import annotations

from rich.console import Group
from rich.syntax import Syntax
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Collapsible, Static

from eyas.state import display

from ..live import Changes
from .base import EyasScreen


def error_title(err: dict) -> str:
    """`Type: message`, or `Type (empty message)`, as `eyas errors` writes it."""
    message = err.get("message") or ""
    return f"{err['type']}: {message}" if message.strip() else f"{err['type']} (empty message)"


def copy_text(err: dict) -> str:
    return f"{error_title(err)}\n{err['traceback'] or ''}".rstrip() + "\n"


def error_body(err: dict) -> Group:
    where = [display.rank_label(err)]
    where += [f"pid {err['pid']}"] if err["pid"] is not None else []
    where += [f"on {err['host']}"] if err["host"] else []
    where += [display.local_second(err["time"])]
    where += [f"from {err['source']}"] if err["source"] else []
    parts = [Text(" · ".join(where), style="dim"), Text(error_title(err), style="bold red")]
    tb = (err["traceback"] or "").rstrip()
    if tb:
        parts.append(Syntax(tb, "pytb", theme="ansi_dark", word_wrap=True, background_color="default"))
    else:
        parts.append(Text("(no traceback)", style="dim"))
    parts.append(Text(f"error file: {err['path']}" if err["path"] else "error file: – (none written)", style="dim"))
    return Group(*parts)


def empty_text(run_id: int, run: dict | None) -> str:
    """Why a run has no errors to show: every attempt succeeded, it has not failed yet, it was
    stopped, or it ended without a record (which `eyas errors` shows the same way)."""
    if run is None:
        return f"No run {run_id} in the store."
    attempts = [a for s in run["stages"] for a in s["attempt_list"]]
    states = [a["state"] for a in attempts]
    if run["state"] in ("pending", "running"):
        where = f" (it is at {run['stage']})" if run.get("stage") else ""
        return f"No errors: run {run_id} has not failed yet{where}. Failures appear here as they are recorded."
    if not attempts:
        return f"No errors: run {run_id} ran no attempt ({run['state']})."
    if run["state"] == "succeeded" and all(st == "succeeded" for st in states):
        n = len(attempts)
        return f"No errors: every attempt of run {run_id} succeeded ({n} attempt{'s' if n != 1 else ''})."
    counts = ", ".join(f"{states.count(st)} {st}" for st in dict.fromkeys(states))
    why = f": {run['reason']}" if run.get("reason") else ""
    return f"No errors recorded: run {run_id} {run['state']}{why} (attempts: {counts})."


class ErrorsScreen(EyasScreen):
    DEFAULT_CSS = """
    ErrorsScreen #head { height: auto; padding: 0 1; }
    ErrorsScreen #errors { height: 1fr; padding: 0 1; }
    ErrorsScreen .label { margin-top: 1; text-style: bold; }
    ErrorsScreen .root { border: round $error; padding: 0 1; height: auto; }
    ErrorsScreen Collapsible { padding: 0; margin: 0; }
    """
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("c", "copy", "Copy traceback"),
        Binding("l", "log", "Log of rank"),
    ]

    def __init__(self, run_id: int) -> None:
        super().__init__()
        self.run_id = run_id
        self.errors: list[dict] = []
        self._shown: list[tuple] = []

    def title_text(self) -> str:
        return f"run {self.run_id} › errors"

    def compose_body(self) -> ComposeResult:
        yield Static("", id="head")
        yield VerticalScroll(id="errors", can_focus=True)

    def on_mount(self) -> None:
        self.reload()
        self.query_one("#errors").focus()

    def on_live(self, changes: Changes) -> None:
        if changes.overflow or self.run_id in changes.runs:
            self.reload()

    @property
    def root(self) -> dict | None:
        """The newest attempt's root cause (queries.errors puts it first)."""
        return self.errors[0] if self.errors else None

    def reload(self) -> None:
        self.errors = self.app.history.errors(self.run_id)
        head = self.query_one("#head", Static)
        if not self.errors:
            # Said again on each reload: the run moves on (running, then succeeded).
            self._shown = []
            self.query_one("#errors", VerticalScroll).remove_children()
            head.update(Text(empty_text(self.run_id, self.app.history.run(self.run_id))))
            self.refresh_bindings()
            return
        shown = [(e["stage"], e["attempt"], e["rank"], e["time"]) for e in self.errors]
        if shown == self._shown:
            return
        self._shown = shown
        self.refresh_bindings()
        box = self.query_one("#errors", VerticalScroll)
        box.remove_children()
        attempts = {(e["stage"], e["attempt"]) for e in self.errors}
        head.update(
            f"Run {self.run_id}: {len(self.errors)} failure{'s' if len(self.errors) != 1 else ''} "
            f"in {len(attempts)} attempt{'s' if len(attempts) != 1 else ''}; newest first.  "
            "c copies the root cause's traceback (OSC 52)"
        )
        widgets = []
        first = self.errors[0]
        newest = (first["stage"], first["attempt"])
        label = "Root cause" if first["root_cause"] else "First failure"
        widgets.append(Static(f"{label}: {first['stage']} attempt {first['attempt']}", classes="label"))
        widgets.append(Static(error_body(first), classes="root"))
        others = self.errors[1:]
        same = [e for e in others if (e["stage"], e["attempt"]) == newest]
        older = [e for e in others if (e["stage"], e["attempt"]) != newest]
        if same:
            widgets.append(Static(f"Other failures in {newest[0]} attempt {newest[1]}", classes="label"))
            widgets += [self._collapsed(e) for e in same]
        if older:
            widgets.append(Static("Earlier attempts", classes="label"))
            widgets += [self._collapsed(e, with_attempt=True) for e in older]
        box.mount_all(widgets)

    def _collapsed(self, err: dict, with_attempt: bool = False) -> Collapsible:
        mark = "root cause · " if err["root_cause"] else ""
        where = f"{err['stage']} attempt {err['attempt']} · " if with_attempt else ""
        title = f"{where}{mark}{display.rank_label(err)} · {error_title(err)}"
        c = Collapsible(Static(error_body(err)), title=title[:200], collapsed=True)
        c.error = err
        return c

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Copy and the rank's log are dimmed while there is no error to act on."""
        allowed = super().check_action(action, parameters)
        if allowed and action in ("copy", "log") and not self.errors:
            return None
        return allowed

    def _focused_error(self) -> dict | None:
        node = self.focused
        while node is not None and node is not self:
            if isinstance(node, Collapsible) and not node.collapsed:
                return getattr(node, "error", None)
            node = node.parent
        return self.root

    def action_copy(self) -> None:
        err = self._focused_error()
        if err is None:
            self.notify("No error to copy.", severity="warning")
            return
        self.app.copy_to_clipboard(copy_text(err))
        self.notify(f"Copied rank {err['rank']}'s traceback to the clipboard (OSC 52).")

    def action_log(self) -> None:
        from .logs import LogsScreen

        err = self._focused_error()
        if err is None:
            return
        self.app.push_screen(
            LogsScreen(
                self.run_id,
                err["stage"],
                attempt=err["attempt"],
                rank=err["rank"] if err["rank"] is not None else 0,
                jump_error=True,
            )
        )
