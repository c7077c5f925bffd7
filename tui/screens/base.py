"""What every screen shares: the frame (title bar, banner, footer), the read-only rule for
controls, and running a control through the daemon with a confirmation first."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer

from eyas.wire.client import DaemonError, DaemonNotRunning

from ..live import Changes
from ..widgets.chrome import Banner, TopBar
from ..widgets.modals import ConfirmScreen

# Actions that change something through the daemon: hidden and refused in --readonly.
CONTROLS = frozenset({"submit", "stop_stage", "stop_run", "retry", "skip", "resume", "stacks"})


class EyasScreen(Screen):
    TITLE = ""

    DEFAULT_CSS = """
    EyasScreen #chrome { dock: top; height: auto; }
    """

    def compose(self) -> ComposeResult:
        with Vertical(id="chrome"):
            yield TopBar(self.title_text(), id="topbar")
            yield Banner(id="banner")
        yield from self.compose_body()
        yield Footer()

    def compose_body(self) -> ComposeResult:
        yield from ()

    def title_text(self) -> str:
        return self.TITLE

    def set_title(self, text: str) -> None:
        self.query_one(TopBar).set_title(text)

    # -- live data --------------------------------------------------------------------------

    def on_live(self, changes: Changes) -> None:
        """A batch of daemon events arrived (at most a few times a second)."""

    def reload(self) -> None:
        """Read everything again (after a reconnect, or when the screen comes back)."""

    def on_screen_resume(self) -> None:
        self.reload()

    # -- controls ---------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in CONTROLS and self.app.readonly:
            return False  # hidden from the footer, the palette and the keys
        return True

    def refuse_control(self) -> bool:
        """True (after saying why) when controls cannot be used now."""
        if self.app.readonly:
            self.notify("Read-only: controls are off (started with --readonly).", severity="warning")
            return True
        if not self.app.link.connected:
            self.notify(
                "The eyas daemon is not connected: controls are unavailable until it is back "
                "(start it with `eyas daemon start`).",
                severity="error",
            )
            return True
        return False

    async def control(self, op: str, question: str | None = None, detail: str = "", **args) -> dict | None:
        """Send a control op, after a yes to `question` when given; says how it went."""
        if self.refuse_control():
            return None
        if question is not None and not await self.app.push_screen_wait(ConfirmScreen(question, detail)):
            return None
        try:
            result = await self.app.link.request(op, **args)
        except DaemonNotRunning as exc:
            self.notify(str(exc), severity="error")
            return None
        except DaemonError as exc:
            self.notify(exc.message, title=f"{op} refused", severity="error")
            return None
        self.notify(_done(op, args, result))
        self.reload()
        return result


def _done(op: str, args: dict, result) -> str:
    what = f"run {args.get('run')}" + (f" stage {args['stage']}" if args.get("stage") else "")
    verb = {"stop": "stopping", "retry": "retrying", "skip": "skipped", "resume": "resumed"}.get(op, op)
    if op == "retry" and isinstance(result, dict) and result.get("stage"):
        what = f"run {args.get('run')} stage {result['stage']}"
    if op == "stacks" and isinstance(result, dict):
        said = sum("offset" in r for r in result.get("ranks", []))
        return f"{what}: {said} of {len(result.get('ranks', []))} ranks wrote their stacks into their logs"
    return f"{what}: {verb}"
