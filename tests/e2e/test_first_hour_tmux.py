"""The first hour as a user lives it, in real terminals (tmux): the demo typed into a fresh shell
whose PATH has no .venv/bin, the TUI opened in two more terminals (160x48 and 80x24) while
extract runs, and the command the demo prints typed as printed once it ends.

What is checked on the screens themselves: each TUI follows the run (it shows train while
train runs, evaluate while evaluate starts its vLLM engines, with that wait said in words), and
the printed command opens the finished run. The demo is run as `make demo` runs it (the
Makefile's recipe is `.venv/bin/eyas demo`), with `--home` so that the test's state is its own.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_harness import short_tmp

from eyas.state import paths, queries, store

pytestmark = [
    pytest.mark.slow,
    # Installed by `make test` (test-deps); on a machine without it there is no terminal to drive.
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (make test-deps installs it)"),
]

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
SIZES = {"wide": (160, 48), "small": (80, 24)}
DEMO_BUDGET_S = 600  # the demo's own budget is 5 minutes; tmux and two TUIs load the same 2 cores


class Terminals:
    """tmux sessions on a private server, each a fresh bash that sees none of the test's env."""

    def __init__(self, home: Path):
        self.sock = str(home / "tmux.sock")
        self.env = {
            "HOME": os.environ.get("HOME", "/root"),
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "TERM": "xterm-256color",
            "LANG": "C.UTF-8",
            "XDG_RUNTIME_DIR": str(home / "rt"),
            "PS1": "$ ",
        }

    def tmux(self, *args: str) -> str:
        out = subprocess.run(["tmux", "-S", self.sock, *args], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, (args, out.stderr)
        return out.stdout

    def open(self, name: str, size: tuple[int, int]) -> None:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        shell = f"cd {shlex.quote(str(REPO))} && exec env -i {env} bash --noprofile --norc"
        self.tmux("new-session", "-d", "-s", name, "-x", str(size[0]), "-y", str(size[1]), shell)
        self.tmux("set-option", "-t", name, "history-limit", "20000")

    def type(self, name: str, line: str) -> None:
        self.tmux("send-keys", "-t", name, "-l", line)
        self.tmux("send-keys", "-t", name, "Enter")

    def screen(self, name: str) -> str:
        """What the terminal shows now."""
        return self.tmux("capture-pane", "-p", "-t", name)

    def scrollback(self, name: str) -> str:
        """Everything printed, wrapped lines joined back."""
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", name)

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.sock, "kill-server"], capture_output=True, timeout=30)


def _running(home: Path, run_id: int = 1) -> set[str]:
    """The run's running stages, as the store has them now (none before it exists)."""
    try:
        db = store.open_reader(paths.db_path(home))
    except Exception:
        return set()
    try:
        run = queries.get_run(db, run_id)
    except Exception:
        return set()
    finally:
        db.conn.close()
    return {s["name"] for s in run["stages"] if s["state"] == "running"} if run else set()


def test_the_first_hour_in_real_terminals():
    home = short_tmp()
    t = Terminals(home)
    eyas = VENV_BIN / "eyas"
    try:
        t.open("demo", SIZES["wide"])
        t.type("demo", f".venv/bin/eyas --home {home} demo")  # what `make demo` runs, in its own home

        # The TUI, opened in two terminals once extract runs, as the user would from their shell.
        deadline = time.monotonic() + DEMO_BUDGET_S
        while "extract" not in _running(home):
            assert time.monotonic() < deadline, t.scrollback("demo")[-3000:]
            time.sleep(0.5)
        for name, size in SIZES.items():
            t.open(name, size)
            t.type(name, f"{eyas} --home {home} tui 1")

        # What each terminal shows while each stage runs, sampled until the demo ends.
        seen: dict[str, set[str]] = {name: set() for name in SIZES}
        engine_wait: dict[str, str] = {}
        while "demo took" not in t.scrollback("demo"):
            assert time.monotonic() < deadline, t.scrollback("demo")[-3000:]
            running = _running(home)
            for name in SIZES:
                screen = t.screen(name)
                for stage in running:
                    if f"{stage} running" in screen:
                        seen[name].add(stage)
                if "evaluate" in running:
                    wait = re.search(r"evaluate running\s+·\s+(starting vLLM engines? [^\n│]*)", screen)
                    if wait:
                        engine_wait[name] = wait.group(1).strip()
            time.sleep(0.3)

        for name in SIZES:
            # Opened during extract, each TUI moved on with the run: train, then evaluate.
            assert {"extract", "train", "evaluate"} <= seen[name], (name, seen[name], t.screen(name))
            # While evaluate starts its engines, the screen says so in place of an ETA.
            assert name in engine_wait and re.match(r"starting vLLM engines? \d", engine_wait[name]), (
                name,
                engine_wait,
            )
        printed = t.scrollback("demo")
        assert "run 1 demo: succeeded" in printed, printed[-3000:]
        # The shell has no .venv/bin on PATH: the demo says how to put it there, and prints
        # commands that work without it.
        assert f'export PATH="{VENV_BIN}:$PATH"' in printed
        command = re.search(r"open it in the TUI:\s+(.+ tui 1)\s*$", printed, re.M).group(1).strip()
        assert command == f"{eyas} --home {home} tui 1", command

        # The printed command, typed as printed in a fresh shell (80x24), opens the finished run.
        for name in SIZES:
            t.type(name, "q")
        t.open("after", SIZES["small"])
        t.type("after", command)
        t0 = time.monotonic()
        while not ("demo" in (s := t.screen("after")) and "succeeded" in s and "evaluate" in s):
            assert time.monotonic() - t0 < 60, s
            time.sleep(0.3)
        t.type("after", "q")
        t0 = time.monotonic()
        while "$ " not in t.screen("after").rstrip().splitlines()[-1]:
            assert time.monotonic() - t0 < 30, t.screen("after")  # the TUI quits back to the shell
            time.sleep(0.2)
    finally:
        t.close()
        subprocess.run(
            [str(eyas), "--home", str(home), "daemon", "stop", "--grace", "2"],
            env={**os.environ, "XDG_RUNTIME_DIR": str(home / "rt")},
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(home, ignore_errors=True)
