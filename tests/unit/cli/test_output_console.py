"""The CLI's console never splits a printed line when its output is piped (cli/output.py)."""

from __future__ import annotations

import io
import os
import pty

from eyas.cli import output

COMMAND = "eyas --home /tmp/" + "a-long-state-directory/" * 6 + "home logs 1 --stage train"


def test_piped_output_keeps_a_long_command_on_one_line():
    buf = io.StringIO()  # not a terminal: what `eyas demo | tee demo.log` writes to
    output.console(buf).print(f"or: [bold]{COMMAND}[/bold]")
    assert len(COMMAND) > 80
    assert buf.getvalue() == f"or: {COMMAND}\n"
    buf = io.StringIO()
    output.console(buf).print("or: " + "word " * 40)
    assert buf.getvalue().count("\n") == 1


def test_a_terminal_still_wraps_at_its_width():
    main, sub = pty.openpty()
    try:
        with os.fdopen(sub, "w", closefd=False) as tty:
            console = output.console(tty)
            console.width = 80
            with console.capture() as captured:
                console.print("or: " + "word " * 40)
        lines = captured.get().splitlines()
        assert len(lines) == 3 and max(len(line) for line in lines) <= 80
    finally:
        os.close(main)
        os.close(sub)
