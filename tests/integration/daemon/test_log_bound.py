"""Rank logs stay under stages.<name>.log_max_mb: real daemon, real flooding ranks, real readers."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

from daemon_harness import EYAS, daemon, selftest_toml, wait_for  # noqa: F401 (fixture)

from eyas.daemon.logsplit import LogSplitter
from eyas.state.logcut import MIB, Bound, Tail
from eyas.wire.client import Client

LINE = re.compile(r"r0 line (\d+) @")
MARK = "eyas: ··· cut "
RATE = 40_000  # lines/s, ~30 bytes each: about 1.2 MB/s, so a 2 MiB bound is passed every ~2 s
# The bound may be passed by what is written between two of the monitor's looks (0.5 s);
# a loaded machine can delay a look, so allow a whole second's flood.
SLACK = RATE * 32


def _numbers(lines) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := LINE.match(line))]


def _attempt_dir(d, run_id: int) -> Path:
    def found():
        stages = d.run(run_id)["stages"]
        attempts = stages[0]["attempt_list"] if stages else []
        return attempts and attempts[0].get("dir")

    got = Path(wait_for(found, 30, what="the attempt's folder"))
    return got if got.is_absolute() else d.home / got


def _after_last_mark(lines: list[str]) -> list[str]:
    last = max(i for i, line in enumerate(lines) if line.startswith(MARK))
    return lines[last + 1 :]


def test_a_flooding_rank_log_is_cut_at_its_bound_and_every_reader_goes_on(daemon):
    run_id = daemon.submit(
        selftest_toml("flood", ranks=1, log_max_mb=2, options={"lines_per_sec": RATE, "duration": 7, "step_time": 0.1})
    )
    directory = _attempt_dir(daemon, run_id)
    log = directory / "rank-0.log"

    # A subscriber, and `eyas logs -f`, follow the log across its cuts.
    got: list[str] = []
    done = threading.Event()

    def subscribe():
        with Client(daemon.socket, timeout=60) as c:
            for ev in c.subscribe(["log"], run=run_id):
                got.append(ev.data["text"])
                if "wrote " in ev.data["text"] or done.is_set():
                    return

    sub = threading.Thread(target=subscribe, daemon=True)
    sub.start()
    follow = subprocess.Popen(
        [EYAS, "logs", str(run_id), "-f"],
        env={**daemon.env, "TZ": "UTC"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    followed: list[str] = []  # drained as it comes: a full pipe would hold -f back past several cuts
    drain = threading.Thread(target=lambda: followed.extend(follow.stdout), daemon=True)
    drain.start()
    sizes = []
    while daemon.run(run_id)["state"] not in ("succeeded", "failed", "cancelled"):
        if log.exists():
            sizes.append(log.stat().st_size)
        time.sleep(0.05)
    run = daemon.wait_run(run_id)
    sub.join(30)
    done.set()
    follow.wait(60)
    drain.join(10)

    assert run["state"] == "succeeded", daemon.diagnose(run_id)
    assert max(sizes) <= 2 * MIB + SLACK, (max(sizes), 2 * MIB + SLACK)
    lines = log.read_text().splitlines()
    marks = [line for line in lines if line.startswith(MARK)]
    assert len(marks) == 1 and "(rank-0.log passed stages.selftest.log_max_mb = 2;" in marks[0], marks
    numbers = _numbers(lines)
    total = int(next(m.group(1) for line in lines if (m := re.search(r"selftest: wrote (\d+) lines", line))))
    # The head (start-up, then the first numbered lines) and the latest output both stay;
    # after the cut the lines run on without a gap to the last one written.
    assert numbers[:3] == [0, 1, 2] and numbers[-1] == total - 1
    after = _numbers(_after_last_mark(lines))
    assert after == list(range(after[0], total)) and after[0] > 0

    # The subscriber got the marker and went on receiving lines after it.
    streamed = "".join(got).splitlines()
    assert any(line.startswith(MARK) for line in streamed), streamed[-5:]
    # (Its last lines may be missed: the stream of a group that ended is not pumped again.)
    went_on = _numbers(_after_last_mark(streamed))
    assert len(went_on) > 1000 and went_on == list(range(went_on[0], went_on[-1] + 1))

    # `eyas logs -f` printed each cut's marker and carried on from it; `eyas logs` prints the cut log.
    assert follow.returncode == 0, follow.stderr.read()
    shown = [line.removeprefix("[r0] ").rstrip("\n") for line in followed]
    assert sum(line.startswith(MARK) for line in shown) >= 2, shown[-5:]
    tail = _numbers(_after_last_mark(shown))
    assert tail == list(range(tail[0], total))
    printed = daemon.cli("logs", run_id)
    assert printed.returncode == 0 and [line.removeprefix("[r0] ") for line in printed.stdout.splitlines()] == lines


def test_split_logs_are_cut_at_the_bound_the_driver_monitor_recorded(tmp_path):
    raw = tmp_path / "rank-0.log"
    raw.write_bytes(b"")
    Bound(raw, 4096, "stages.extract.log_max_mb = 0.004").record()  # as the monitor does at start
    splitter = LogSplitter(raw, tmp_path / "rank-0.split.json")
    with open(raw, "ab") as f:
        for n in range(2000):
            f.write(f"(Worker_TP1 pid=7) line {n}\n".encode())
            if n % 50 == 49:
                splitter.pump(lambda pid: None)
    splitter.pump(lambda pid: None, final=True)
    tp1 = (tmp_path / "tp-1.log").read_text().splitlines()
    assert (tmp_path / "tp-1.log").stat().st_size <= 4096 + 51 * 30
    assert tp1[0] == "(Worker_TP1 pid=7) line 0" and tp1[-1] == "(Worker_TP1 pid=7) line 1999"
    assert any(line.startswith(MARK) and "tp-1.log passed stages.extract.log_max_mb = 0.004" in line for line in tp1)


def test_a_tail_goes_on_from_the_marker_after_a_cut_that_regrew_past_it(tmp_path):
    """A reader that looks after the log grew back beyond its offset still notices the cut."""
    path = tmp_path / "rank-0.log"
    path.write_bytes(b"".join(f"line {n}\n".encode() for n in range(1000)))
    tail = Tail(path)
    assert tail.read().endswith(b"line 999\n")
    Bound(path, 2000, "x = 1").check()
    with open(path, "ab") as f:
        f.write(b"".join(f"again {n}\n".encode() for n in range(2000)))
    text = b"".join(iter(tail.read, b"")).decode().splitlines()
    assert text[0].startswith(MARK) and text[1] == "again 0" and text[-1] == "again 1999"
    assert tail.cuts == 1


async def test_the_logs_screen_following_a_log_that_gets_cut_shows_the_marker_and_goes_on(daemon):
    from tui_world import until

    from eyas.tui.app import EyasApp
    from eyas.tui.screens.logs import LogsScreen
    from eyas.tui.screens.run import RunScreen
    from eyas.tui.widgets.logview import LogView

    run_id = daemon.submit(
        selftest_toml(
            "tui-cut", ranks=1, log_max_mb=1, options={"lines_per_sec": 20_000, "duration": 10, "step_time": 0.1}
        )
    )
    app = EyasApp(daemon.home, socket=daemon.socket, run_id=run_id)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen, what="the run screen")
        await until(pilot, lambda: screen.run and screen.run["state"] == "running", timeout=60, what="running")
        await pilot.press("l")
        logs = await until(pilot, lambda: isinstance(app.screen, LogsScreen) and app.screen, what="the logs")
        view = logs.query_one(LogView)
        shown = lambda: _numbers(r.text for r in view.visible_rows())  # noqa: E731
        before = await until(pilot, shown, timeout=30, what="flood lines")
        # The log is cut while followed: the screen says so, the marker is among its lines,
        # and the view goes on with lines written after the cut.
        told = await until(
            pilot,
            lambda: [n.message for n in app._notifications if "was cut" in n.message],
            timeout=30,
            what="the cut to be told",
        )
        assert "rank-0.log was cut at its bound" in told[0]
        await until(pilot, lambda: (n := shown()) and min(n) > max(before), timeout=30, what="lines after the cut")
        rows = view.model.rows(0, view.model.total())
        marks = [r.text for r in rows if r.text.startswith(MARK)]
        assert len(marks) == 1 and "stages.selftest.log_max_mb = 1;" in marks[0]
        after = _numbers(_after_last_mark([r.text for r in rows]))
        assert after and after == list(range(after[0], after[-1] + 1))
        assert logs.watcher.error is None and view.follow
        daemon.request("stop", run=run_id)
