"""The frame every screen shares: a title bar with the connection state, and the banner
that says the daemon is gone (and that the TUI keeps retrying)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from ..link import LinkStatus


class TopBar(Static):
    DEFAULT_CSS = """
    TopBar { height: 1; background: $panel; color: $foreground; padding: 0 1; }
    """

    def __init__(self, title: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.title = title

    def on_mount(self) -> None:
        self.watch(self.app, "link_status", self._show, init=True)

    def set_title(self, title: str) -> None:
        self.title = title
        self._show(self.app.link_status)

    def _show(self, status: LinkStatus) -> None:
        left = Text.assemble(("eyas", "bold"), " › ", self.title)
        if self.app.readonly:
            left.append("  [read-only]", style="yellow")
        if status.connected and status.full:
            right = Text("● daemon · state dir full", style="bold red")
        elif status.connected and status.busy:
            right = Text("● daemon · store busy", style="bold yellow")
        elif status.connected:
            right = Text("● daemon", style="green")
        elif status.ever_connected:
            right = Text("○ reconnecting", style="bold red")
        else:
            right = Text("○ history only", style="yellow")
        width = max(0, self.size.width - 2) if self.size.width else 78
        pad = max(1, width - left.cell_len - right.cell_len)
        self.update(left + Text(" " * pad) + right)

    def on_resize(self) -> None:
        self._show(self.app.link_status)


class Banner(Static):
    """Shown only while the daemon is not connected, its state directory is full, or another
    process holds its database locked."""

    DEFAULT_CSS = """
    Banner { height: auto; padding: 0 1; display: none; }
    Banner.down { display: block; background: $warning 30%; }
    Banner.lost { display: block; background: $error 40%; }
    Banner.full { display: block; background: $error 40%; }
    Banner.busy { display: block; background: $warning 30%; }
    """

    def on_mount(self) -> None:
        self.watch(self.app, "link_status", self._show, init=True)

    def _show(self, status: LinkStatus) -> None:
        self.set_class(not status.connected and status.ever_connected, "lost")
        self.set_class(not status.connected and not status.ever_connected, "down")
        self.set_class(status.connected and bool(status.full), "full")
        self.set_class(status.connected and not status.full and bool(status.busy), "busy")
        if status.connected and status.full:
            self.update(
                f"The daemon's state directory is full ({status.full}): no attempt starts and "
                "the record waits until space returns. Free space there; eyas goes on by itself."
            )
        elif status.connected and status.busy:
            self.update(
                f"Store busy: another process holds eyas.db locked ({status.busy}). Supervision goes "
                "on; no attempt starts and the record waits until the lock is released."
            )
        elif status.connected:
            self.update("")
        elif status.ever_connected:
            self.update(
                "Lost the eyas daemon: live updates and controls are paused, history stays readable. "
                "Reconnecting with backoff (ctrl+r: now)."
            )
        else:
            self.update(
                "The eyas daemon is not running: showing read-only history from SQLite. "
                "Start it with `eyas daemon start`; the TUI connects when it is up."
            )
