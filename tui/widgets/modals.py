"""Modal dialogs: confirming a destructive action, and submitting a run config by path.

Their text wraps to the dialog's width and a long refusal scrolls inside it, so that each reads
whole from 80x24 up."""

from __future__ import annotations

import os
from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.suggester import Suggester
from textual.widgets import Button, Input, Label, Static

from eyas.wire.client import DaemonError, DaemonNotRunning


class ConfirmScreen(ModalScreen[bool]):
    """Yes or no; `y` and `n` answer, escape says no."""

    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Vertical { width: 60; max-width: 95%; height: auto; max-height: 95%; border: thick $error; background: $surface; padding: 1 2; }
    ConfirmScreen #question { width: 100%; }
    ConfirmScreen Horizontal { height: auto; align-horizontal: right; margin-top: 1; }
    ConfirmScreen Button { margin-left: 2; }
    """
    BINDINGS = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n", "answer(False)", "No"),
        Binding("escape", "answer(False)", "Cancel", show=False),
    ]

    def __init__(self, question: str, detail: str = "") -> None:
        super().__init__()
        self.question = question
        self.detail = detail

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question, id="question")
            if self.detail:
                yield Static(self.detail, id="detail")
            with Horizontal():
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class PathSuggester(Suggester):
    """Completes a filesystem path one entry at a time, as a shell's tab does."""

    def __init__(self) -> None:
        super().__init__(use_cache=False, case_sensitive=True)

    async def get_suggestion(self, value: str) -> str | None:
        if not value:
            return None
        path = Path(os.path.expanduser(value))
        folder, stem = (path, "") if value.endswith("/") else (path.parent, path.name)
        try:
            names = sorted(
                e.name + ("/" if e.is_dir() else "")
                for e in os.scandir(folder)
                if e.name.startswith(stem) and not e.name.startswith(".")
            )
        except OSError:
            return None
        # Prefer run configs, then folders.
        names.sort(key=lambda n: (not n.endswith(".toml"), not n.endswith("/"), n))
        if not names:
            return None
        return value + names[0][len(stem) :]


class SubmitScreen(ModalScreen[dict | None]):
    """A path input for a run config; submits it through the daemon, shows its refusal."""

    DEFAULT_CSS = """
    SubmitScreen { align: center middle; }
    SubmitScreen > Vertical { width: 84; max-width: 98%; height: auto; max-height: 98%; border: thick $primary; background: $surface; padding: 1 2; }
    SubmitScreen #title { text-style: bold; }
    SubmitScreen #help { color: $text-muted; margin-bottom: 1; }
    SubmitScreen #refusal { height: auto; max-height: 12; margin-top: 1; display: none; }
    SubmitScreen #refusal.shown { display: block; }
    SubmitScreen #error { color: $error; height: auto; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, initial: str = "") -> None:
        super().__init__()
        self.initial = initial

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("Submit a run config (TOML)", id="title")
            yield Static("Type its path: → accepts the completion, enter submits, escape cancels.", id="help")
            yield Input(self.initial, placeholder="path/to/run.toml", suggester=PathSuggester(), id="path")
            with VerticalScroll(id="refusal"):  # a refusal lists every mistake: it may be long
                yield Static("", id="error")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def action_cancel(self) -> None:
        self.dismiss(None)

    def _refuse(self, text: str) -> None:
        self.query_one("#error", Static).update(Text(text))  # a config's [tables] are no markup
        box = self.query_one("#refusal", VerticalScroll)
        box.add_class("shown")
        box.scroll_home(animate=False)

    async def on_input_submitted(self, event: Input.Submitted) -> None:
        value = event.value.strip()
        if not value:
            self._refuse("Type the path of a run config.")
            return
        path = Path(os.path.expanduser(value)).absolute()
        if not path.is_file():
            self._refuse(f"{path}: no such file; give the path of a run config (.toml)")
            return
        try:
            result = await self.app.link.request("submit", config_path=str(path))
        except DaemonNotRunning as exc:
            self._refuse(str(exc))
            return
        except DaemonError as exc:
            self._refuse(f"The daemon refused {path.name}:\n{exc.message}")
            return
        self.dismiss(result)


class KeysScreen(ModalScreen[None]):
    """`?`: the keys of the screen underneath (what it offers now), then the global ones."""

    DEFAULT_CSS = """
    KeysScreen { align: center middle; }
    KeysScreen > VerticalScroll { width: 64; max-width: 98%; height: auto; max-height: 95%;
                                  border: thick $primary; background: $surface; padding: 0 1; }
    """
    BINDINGS = [Binding("escape,question_mark,q", "close", "Close")]

    def __init__(self, under) -> None:
        super().__init__()
        self.under = under

    def compose(self) -> ComposeResult:
        from rich.table import Table
        from rich.text import Text
        from textual.containers import VerticalScroll

        # Only eyas's own keys (what check_action leaves, so --readonly shows no controls);
        # the widgets' navigation keys are summed up in one line below.
        own = {"screen": type(self.under).BINDINGS, "app": type(self.app).BINDINGS}
        seen, rows = set(), {"screen": [], "app": []}
        for active in self.under.active_bindings.values():
            b = active.binding
            where = "app" if active.node is self.app else "screen"
            if not b.show or b not in own[where] or b.action in seen:
                continue
            seen.add(b.action)
            rows[where].append((self.app.get_key_display(b), b.description + ("" if active.enabled else " (not now)")))
        with VerticalScroll():
            yield Static(Text("Keys", style="bold"))
            for group, title in (("screen", "This screen"), ("app", "Everywhere")):
                t = Table(box=None, show_header=False, pad_edge=False)
                t.add_column("key", style="bold", no_wrap=True, width=12)
                t.add_column("action")
                for k, d in rows[group]:
                    t.add_row(k, d)
                yield Static(Text(title, style="dim"))
                yield Static(t)
            yield Static(Text("arrows, pgup/pgdn, home/end move; enter opens; ctrl+p lists every action", style="dim"))

    def action_close(self) -> None:
        self.dismiss(None)
