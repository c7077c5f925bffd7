"""Native stacks of live processes: `py-spy dump --native` per pid, run without blocking the daemon.

faulthandler (daemon/stacks.py) shows only Python frames, and a hang often sits below them: a
ProcessGroupGloo destructor waiting for a thread that waits for the GIL shows in Python as
nothing but the last line the interpreter ran. py-spy attaches from outside (ptrace) and reads
the C frames as well, and it needs nothing from the target process, so it also reaches a rank
that is finalising or a vLLM TP worker. It runs as an asyncio subprocess with a timeout, so the
daemon's event loop never waits on it. Where it cannot run (no binary, no ptrace permission)
the dump is one line saying why, and the Python stacks still come from faulthandler.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

# A process with torch loaded has large symbol tables to read; a few seconds is normal.
TIMEOUT = 20.0
# For `eyas stacks` and the TUI's `t`: the reply must come within the TUI's 10 s request limit.
INTERACTIVE_TIMEOUT = 7.0
# The environment variable that names the py-spy binary (where it is not beside the
# interpreter or on PATH; tests also point it at a missing file).
BINARY_ENV = "EYAS_PY_SPY"


def binary() -> str | None:
    """The py-spy to run: $EYAS_PY_SPY, else the one installed beside this interpreter (the
    daemon's PATH may lack the virtual environment's bin), else PATH's."""
    named = os.environ.get(BINARY_ENV)
    if named:
        return named
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _reason(text: str) -> str:
    """py-spy's own complaint in one line (its first non-empty one)."""
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line[:300] or "no output"


async def dump(pid: int, timeout: float = TIMEOUT) -> dict:
    """{"native": text} with every thread's native and Python frames, or {"native_skipped": why}."""
    exe = binary()
    if exe is None:
        return {"native_skipped": "py-spy is not installed (pip install py-spy)"}
    try:
        proc = await asyncio.create_subprocess_exec(
            exe,
            "dump",
            "--native",
            "--pid",
            str(pid),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        return {"native_skipped": f"cannot run {exe}: {exc.strerror or exc}"}
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return {"native_skipped": f"py-spy did not finish within {timeout:g} s"}
    text = out.decode(errors="replace").strip()
    if proc.returncode != 0 or not text:
        why = _reason(err.decode(errors="replace") or text)
        return {"native_skipped": f"py-spy could not dump pid {pid}: {why}"}
    return {"native": text}


async def add_to(entries: list[dict], timeout: float = TIMEOUT) -> list[dict]:
    """Dump every live process of `entries` (stacks.request records) at once, in place."""
    for e in entries:
        if e.get("state") in ("stopped", "tracing-stop") and "skipped" not in e:
            # A stopped process runs nothing that could be read consistently, and py-spy's
            # attach to one fails or waits out its timeout: say why instead.
            e["native_skipped"] = "it is stopped: no stacks can be taken until it is continued (kill -CONT)"
    live = [e for e in entries if "skipped" not in e and "native_skipped" not in e and e.get("pid")]
    for e, found in zip(live, await asyncio.gather(*(dump(e["pid"], timeout) for e in live))):
        e.update(found)
    return entries
