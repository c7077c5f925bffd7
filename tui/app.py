"""`eyas tui`: the Textual control panel that attaches to the daemon.

The app owns three things and hands them to its screens: a History (read-only SQLite), a
DaemonLink (the socket, reconnected with backoff) and a Live store (what the daemon's
events said). Batches of events reach the active screen only; the others re-read when they
come back. With the daemon down, everything but the controls works from the store.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.reactive import var
from textual.screen import Screen

from eyas.state import paths
from eyas.wire.protocol import Event

from .history import History
from .link import DaemonLink, LinkStatus
from .live import Live
from .screens.base import EyasScreen
from .screens.runs import RunsScreen

# How long the first screen waits for the first connection attempt, so that it opens
# knowing whether the daemon is there (a missing socket fails at once).
FIRST_CONNECT_S = 2.0


class EyasApp(App):
    TITLE = "eyas"
    CSS = """
    Screen { background: $background; }
    DataTable { background: $surface; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "keys", "Keys"),
        Binding("ctrl+r", "reconnect", "Reconnect", show=False),
    ]

    link_status: var[LinkStatus] = var(LinkStatus(False, False, "not connected yet", 0, None))

    def __init__(
        self,
        home: Path | None = None,
        *,
        run_id: int | None = None,
        readonly: bool = False,
        socket: Path | None = None,
        clock: Callable[[], float] = time.time,
        connect: bool = True,
        batch_interval: float = 0.25,
    ):
        super().__init__()
        self.home = Path(home) if home is not None else paths.state_dir()
        self.start_run = run_id
        self.readonly = readonly
        self.history = History(self.home, clock)
        self.live = Live()
        self.connect = connect
        self.link = DaemonLink(
            socket if socket is not None else lambda: paths.find_socket(self.home),
            self._on_status,
            self._on_batch,
            batch_interval=batch_interval,
        )

    async def on_mount(self) -> None:
        if self.connect:
            self.run_worker(self.link.run(), group="link", name="daemon link")
            try:
                await _wait(self.link.first_attempt, FIRST_CONNECT_S)
            except TimeoutError:
                pass
        else:
            self._on_status(LinkStatus(False, False, "not connecting (history only)", 0, None))
        await self.push_screen(RunsScreen())
        if self.start_run is not None:
            from .screens.run import RunScreen

            await self.push_screen(RunScreen(self.start_run))

    async def on_unmount(self) -> None:
        await self.link.close()
        self.history.close()

    # -- the link's callbacks ---------------------------------------------------------------

    def _on_status(self, status: LinkStatus) -> None:
        was = self.link_status.connected
        self.link_status = status
        if status.connected and not was:
            # Back after an absence: what happened meanwhile is in the store.
            for screen in self.screen_stack:
                if isinstance(screen, EyasScreen) and screen.is_current:
                    screen.reload()
        for screen in self.screen_stack:
            screen.refresh_bindings()

    def _on_batch(self, events: list[Event]) -> None:
        changes = self.live.apply(events)
        screen = self.screen
        if isinstance(screen, EyasScreen):
            screen.on_live(changes)
        elif len(self.screen_stack) > 1 and isinstance(self.screen_stack[-2], EyasScreen):
            self.screen_stack[-2].on_live(changes)  # a modal is open over it

    # -- actions -------------------------------------------------------------------------------

    def action_keys(self) -> None:
        """`?`: the keys of the current screen, in a dialog that `?` or escape closes."""
        from .widgets.modals import KeysScreen

        if not isinstance(self.screen, KeysScreen):
            self.push_screen(KeysScreen(self.screen))

    def action_reconnect(self) -> None:
        self.link.retry_now()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """The command palette: Textual's commands, then every action the screen offers now
        (controls are missing in --readonly, as check_action hides them)."""
        yield from super().get_system_commands(screen)
        seen = set()
        for key, active in screen.active_bindings.items():
            b = active.binding
            if not b.description or b.action in seen or b.action in ("quit", "keys") or active.node is self:
                continue
            seen.add(b.action)
            node = active.node
            yield SystemCommand(
                b.description, f"{b.description} (key: {b.key_display or key})", partial(node.run_action, b.action)
            )


async def _wait(event, timeout: float) -> None:
    import asyncio

    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        raise TimeoutError from None


def command(args) -> int:
    """The `eyas tui [RUN] [--readonly] [--serve [--port P] [--host H]]` entry point."""
    serving = getattr(args, "serve", False)
    if not serving and (
        getattr(args, "host", None) or getattr(args, "port", None) or getattr(args, "not_loopback", False)
    ):
        print("eyas tui: --host, --port and --i-know-this-is-not-loopback go with --serve", file=sys.stderr)
        return 2
    if serving:
        from .serve import DEFAULT_HOST, check_bind

        refused = check_bind(args.host or DEFAULT_HOST, bool(args.not_loopback))
        if refused is not None:
            return refused
    home = paths.state_dir()
    probe = History(home)
    try:
        _ = probe.db  # a store newer than this eyas is refused here, in one line
        if args.run is not None and probe.run(args.run) is None:
            print(f"eyas tui: no run {args.run} (see `eyas runs`)", file=sys.stderr)
            return 1
    except RuntimeError as exc:
        print(f"eyas tui: {exc}", file=sys.stderr)
        return 2
    finally:
        probe.close()
    if serving:
        from .serve import serve

        return serve(args, home)
    app = EyasApp(home, run_id=args.run, readonly=bool(args.readonly))
    app.run()
    return app.return_code or 0
