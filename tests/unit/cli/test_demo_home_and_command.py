"""The demo's own home and the command it prints (cli/demo.py): the home is `--home`'s or
`.eyas-demo` here, never $EYAS_HOME; the printed `eyas` is the bare name only when that name
on PATH is this install, else a path that runs from any shell."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from eyas.cli import demo

VENV_BIN = Path(sys.executable).parent


def test_the_demo_home_is_its_own_whatever_eyas_home_says(tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_HOME", str(tmp_path / "real-state"))
    monkeypatch.chdir(tmp_path)
    assert demo.demo_home() == tmp_path / ".eyas-demo"
    assert demo.demo_home("elsewhere") == tmp_path / "elsewhere"


def test_the_printed_eyas_is_a_full_path_when_path_lacks_this_install(monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    printed = demo.eyas_command()
    assert printed == str((VENV_BIN / "eyas").absolute())
    # It runs as printed from a shell with that PATH.
    out = subprocess.run(["bash", "-c", f"{printed} --help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "demo" in out.stdout, out.stderr


def test_the_printed_eyas_is_the_bare_name_when_path_finds_this_install(monkeypatch):
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}/usr/bin:/bin")
    assert demo.eyas_command() == "eyas"


def test_another_eyas_first_on_path_is_not_taken_for_this_one(tmp_path, monkeypatch):
    other = tmp_path / "bin"
    other.mkdir()
    (other / "eyas").write_text("#!/bin/sh\necho another eyas\n")
    (other / "eyas").chmod(0o755)
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}{VENV_BIN}")
    assert demo.eyas_command() == str((VENV_BIN / "eyas").absolute())
