"""`eyas demo`: the main job on embedded defaults, through a private daemon.

It starts a daemon for the demo's own state directory when none runs, builds the tiny test
assets (a DeepSeek-V3-shaped target and synthetic chats) in a child process, submits the
whole pipeline (prepare -> extract -> vocab -> train on 2 ranks with the transformers backend,
then evaluate: the trained draft's acceptance in vLLM's CPU build beside an untrained one) with
workers/examples/demo.toml as its config, shows live progress and ends with a summary table
and the command that opens the TUI on the run. Ctrl-C cancels the run and stops the daemon
it started: nothing is left running.

The CLI process never imports torch: the assets are built by `python -m eyas.workers.models.assets`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import eyas.workers
from eyas.state import paths
from eyas.state import runconfig as run_config
from eyas.wire.client import Client, DaemonError, DaemonNotRunning

# The demo's config is the commented example shipped with the package.
DEMO_TOML = Path(eyas.workers.__file__).parent / "examples" / "demo.toml"
# The demo's target has its output head fitted to the chats (eyas.workers.models.assets.fit_to_chats),
# so that its answers are something a draft can learn to predict.
FIT_STEPS = 300


def demo_home() -> Path:
    """$EYAS_HOME when set, else a private `.eyas-demo` directory here."""
    return Path(os.environ["EYAS_HOME"]) if os.environ.get("EYAS_HOME") else Path.cwd() / ".eyas-demo"


def _ensure_daemon() -> bool:
    """Start the demo's daemon unless one runs; True when this call started it."""
    try:
        with Client(timeout=2) as c:
            c.request("ping")
            return False
    except (DaemonNotRunning, DaemonError, OSError, TimeoutError):
        pass
    from argparse import Namespace

    from .lifecycle import start

    if start(Namespace(foreground=False, grace=10.0)) != 0:
        raise SystemExit(1)
    return True


def command(args) -> int:
    from rich.console import Console

    home = demo_home()
    os.environ["EYAS_HOME"] = str(home)
    home.mkdir(parents=True, exist_ok=True)
    console = Console()
    console.print(f"[bold]eyas demo[/bold]: state in {home}")
    t0 = time.monotonic()
    started = _ensure_daemon()
    try:
        code = _run_demo(home, console)
        console.print(f"demo took {time.monotonic() - t0:.0f}s")
        return code
    except KeyboardInterrupt:
        console.print("stopped")
        return 130
    finally:
        if started:
            # The demo leaves nothing running behind it; history stays readable without it.
            from argparse import Namespace

            from .lifecycle import stop

            stop(Namespace(grace=None))


def build_assets(target_dir: Path, console) -> bool:
    """Build the tiny target and the chats in a child process (it imports torch, we do not)."""
    with console.status(f"building the tiny target and chat data in {target_dir} …"):
        proc = subprocess.run(
            [sys.executable, "-m", "eyas.workers.models.assets", str(target_dir), "--fit-steps", str(FIT_STEPS)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
        )
    if proc.returncode != 0:
        console.print(f"[red]building the demo assets failed (exit {proc.returncode}):[/red]")
        console.print(proc.stderr[-3000:], markup=False, highlight=False)
        return False
    console.print(f"assets ready in {target_dir}")
    return True


def _run_demo(home: Path, console) -> int:
    from .follow import follow

    if not build_assets(home / "assets", console):
        return 1
    config = home / "demo.toml"
    config.write_text(DEMO_TOML.read_text())
    with Client() as c:
        try:
            run_id = c.request("submit", config_path=str(config))["run_id"]
        except DaemonError as exc:
            console.print(f"[red]{exc.message}[/red]")
            return 1
    console.print(f"run {run_id} submitted: {' -> '.join(_pipeline(config))}, on CPU")
    try:
        code = follow(run_id, console)
    except KeyboardInterrupt:
        console.print("stopping the run…")
        with Client() as c:
            try:
                c.request("stop", run=run_id)
            except DaemonError as exc:
                console.print(exc.message)
        _wait_ended(run_id)
        return 130
    console.print(f"\nopen it in the TUI:  [bold]eyas --home {home} tui {run_id}[/bold]")
    console.print(
        f"or:                  [bold]eyas --home {home} show {run_id}[/bold]   ·   "
        f"[bold]eyas --home {home} logs {run_id} --stage train[/bold]"
    )
    return code


def _pipeline(config: Path) -> list[str]:
    """The stages the daemon will run for `config` (its own validation; the CLI has no torch)."""
    try:
        return list(run_config.load(config).pipeline)
    except run_config.ConfigError:
        return ["?"]


def _wait_ended(run_id: int, timeout: float = 60) -> None:
    from eyas.state import queries

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        db = queries.connect(paths.db_path())
        try:
            if queries.get_run(db, run_id)["state"] in ("succeeded", "failed", "cancelled"):
                return
        finally:
            db.close()
        time.sleep(0.2)
    print(f"run {run_id} did not end within {timeout:.0f}s", file=sys.stderr)
