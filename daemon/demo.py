"""`eyas demo`: the main job on embedded defaults, through a private daemon.

Until the data and training stages land, the end-to-end path that exists is the
supervisor itself: a 2-rank `selftest` stage that reports progress and metrics like a
real stage. The demo starts a daemon for its own state directory when none runs, submits
the run, shows live progress and ends with a summary table.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from eyas.state import paths

from .client import Client, DaemonError, DaemonNotRunning

DEMO_TOML = """\
# The eyas demo run (embedded default). Two ranks supervised by the daemon.
name = "demo"
pipeline = ["selftest"]

[resources]
ranks = 2
devices = "cpu"

[stages.selftest]
max_restarts = 1
options = { steps = 40, step_time = 0.1, tokens_per_step = 512 }
"""


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
    started = _ensure_daemon()
    try:
        return _run_demo(home, console)
    finally:
        if started:
            # The demo leaves nothing running behind it; history stays readable without it.
            from argparse import Namespace

            from .lifecycle import stop

            stop(Namespace(grace=None))


def _run_demo(home: Path, console) -> int:
    from .follow import follow

    config = home / "demo.toml"
    config.write_text(DEMO_TOML)
    with Client() as c:
        run_id = c.request("submit", config_path=str(config))["run_id"]
    console.print(f"run {run_id} submitted")
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
    console.print(f"\nnext: [bold]eyas --home {home} show {run_id}[/bold]   ·   "
                  f"[bold]eyas --home {home} logs {run_id}[/bold]")
    return code


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
