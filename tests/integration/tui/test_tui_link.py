"""The TUI's daemon link: batched delivery at a bounded rate, reconnection with backoff, and
the `eyas tui` entry point."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from eyas.tui.link import DaemonLink
from eyas.tui.live import Live
from eyas.wire.protocol import Event

EYAS = str(Path(sys.executable).with_name("eyas"))


async def test_a_flood_of_events_is_delivered_whole_in_a_bounded_number_of_batches(tmp_path):
    batches: list[list[Event]] = []
    link = DaemonLink(tmp_path / "none.sock", lambda s: None, batches.append, batch_interval=0.2)
    t0 = time.monotonic()
    sent = 0
    # At least 1 s and 2,000 events, in bursts as a socket read delivers them (a loaded
    # machine sends fewer per second; the count is what the test is about).
    while time.monotonic() - t0 < 1.0 or sent < 2000:
        for _ in range(50):
            link._queue(Event(sub=1, event="metric", data={"run_id": 1, "n": sent}))
            sent += 1
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.5)
    elapsed = time.monotonic() - t0
    assert [e.data["n"] for b in batches for e in b] == list(range(sent))
    assert sent > 2000
    assert len(batches) <= elapsed / 0.2 + 2, len(batches)  # one redraw per interval, not per event
    assert link.batches == len(batches)


async def test_without_a_daemon_it_retries_with_growing_backoff(tmp_path):
    statuses = []
    link = DaemonLink(tmp_path / "none.sock", statuses.append, lambda events: None, min_backoff=0.05, max_backoff=0.2)
    task = asyncio.create_task(link.run())
    try:
        await asyncio.wait_for(link.first_attempt.wait(), 5)
        deadline = time.monotonic() + 10
        while len(statuses) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        await link.close()
        task.cancel()
    assert [s.retry_in for s in statuses[:5]] == [0.05, 0.1, 0.2, 0.2, 0.2]
    assert [s.attempts for s in statuses[:5]] == [1, 2, 3, 4, 5]
    assert not any(s.connected or s.ever_connected for s in statuses)
    assert "eyas daemon is not running" in statuses[0].message


def test_live_keeps_stage_figures_and_samples_and_drops_ended_stages():
    live = Live()
    ch = live.apply(
        [
            Event(
                1,
                "metric",
                {
                    "run_id": 4,
                    "stage": "train",
                    "attempt": 1,
                    "live": {"tok_s": 10.0, "eta_s": 5.0},
                    "samples": [
                        {
                            "time": 1.0,
                            "run_id": 4,
                            "stage": "train",
                            "attempt": 1,
                            "rank": 0,
                            "name": "loss",
                            "value": 2.5,
                        }
                    ],
                },
            ),
            Event(1, "state", {"run_id": 7, "stage": None, "entity": "run", "to_state": "pending"}),
        ]
    )
    assert (ch.metrics, ch.runs, ch.any_state) == ({4}, {7}, True)
    assert live.stage[(4, "train")] == {"tok_s": 10.0, "eta_s": 5.0}
    assert live.last_any_rank(4, "train", 1, "loss") == 2.5
    ch = live.apply(
        [
            Event(1, "state", {"run_id": 4, "stage": "train", "entity": "stage", "to_state": "failed"}),
            Event(1, "overflow", {"dropped": 3}),
        ]
    )
    assert (4, "train") not in live.stage and ch.overflow and ch.touches(99)


def test_eyas_tui_on_an_unknown_run_says_so_in_one_line(tmp_path):
    env = {**os.environ, "EYAS_HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "rt")}
    out = subprocess.run(
        [EYAS, "tui", "42"], env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert out.returncode == 1
    assert out.stderr == "eyas tui: no run 42 (see `eyas runs`)\n"


def test_eyas_tui_in_a_real_terminal_opens_the_run_and_copies_through_osc52(tmp_path):
    """`eyas tui RUN` in a pseudo-terminal: it opens on the run, and `c` on the Errors screen
    sends the traceback as an OSC 52 clipboard escape, which terminals honour over SSH."""
    import base64
    import fcntl
    import pty
    import select
    import struct
    import termios

    import tui_world as world

    home = tmp_path / "home"
    world.build(home)
    pid, fd = pty.fork()
    if pid == 0:  # the child: the real command on the pty
        os.environ.update(EYAS_HOME=str(home), XDG_RUNTIME_DIR=str(tmp_path / "rt"), TERM="xterm-256color", TZ="UTC")
        os.execv(EYAS, [EYAS, "tui", "2"])
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    seen = bytearray()

    def read_until(needle: bytes, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while needle not in seen:
            assert time.monotonic() < deadline, f"no {needle!r} on the terminal; got {bytes(seen[-400:])!r}"
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    seen.extend(os.read(fd, 65536))
                except OSError:
                    break

    try:
        read_until(b"qwen-draft")
        read_until(b"Root cause of train")
        os.write(fd, b"e")
        read_until(b"Copy traceback")
        os.write(fd, b"c")
        root = world.TRACEBACK.strip().splitlines()[-1]
        text = root + "\n" + world.TRACEBACK
        read_until(b"\x1b]52;c;" + base64.b64encode(text.encode()) + b"\x07")
        os.write(fd, b"q")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    os.read(fd, 65536)
                except OSError:
                    pass
        assert done and os.waitstatus_to_exitcode(status) == 0
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
