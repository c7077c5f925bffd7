"""Bounded phases and the stuck process named, end to end: a heartbeat that is no proof of life,
a phase over its budget, a stopped child of a rank, a stopped rank among working peers, and
`eyas stacks` covering a rank's descendants, against a real daemon and real rank processes."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from daemon_harness import daemon, run_toml, selftest_toml, wait_for  # noqa: F401 (fixture)

SLACK = 6.0  # seconds past a bound: the 1 Hz sampler, the stacks, the teardown, a loaded machine


def _attempt(run: dict) -> dict:
    (attempt,) = run["stages"][0]["attempt_list"]
    return attempt


def _child_pid(d, run_id: int) -> int:
    """The pid of the selftest's engine stand-in, once it runs."""

    def found():
        attempts = d.run(run_id)["stages"][0]["attempt_list"]
        path = Path(attempts[0]["dir"]) / "rank-0.children.json" if attempts and attempts[0]["dir"] else None
        return path if path is not None and path.exists() else None

    children = wait_for(found, timeout=60, what="the engine stand-in")
    return json.loads(children.read_text())["children"][0]


def test_a_heartbeat_without_evidence_is_no_proof_of_life(daemon):
    # The phase's heartbeat thread beats every second; nothing else moves. Before phases had
    # evidence, those beats kept the stage "alive" for as long as the user waited.
    run_id = daemon.submit(
        selftest_toml(
            "no-evidence",
            ranks=1,
            stall_timeout=8,
            options={"steps": 1, "heartbeat_for": 120, "heartbeat_evidence": "none"},
        )
    )
    run = daemon.wait_run(run_id, timeout=8 + 30)
    attempt = _attempt(run)
    root = attempt["root_cause"]
    assert (run["state"], root["type"]) == ("failed", "Stalled"), root
    assert root["message"].startswith("no rank wrote a log line or progress, and no phase's evidence moved, for "), (
        root["message"]
    )
    assert "(stages.selftest.stall_timeout = 8); rank 0 was in its phase 'selftest heartbeat_for'" in (root["message"])
    assert attempt["duration"] <= 8 + SLACK + 5, attempt["duration"]
    assert "rank 0 (pid " in root["traceback"] and "state: sleeping for " in root["traceback"]


def test_moving_evidence_keeps_a_silent_phase_alive(daemon):
    run_id = daemon.submit(selftest_toml("ticks", ranks=1, stall_timeout=6, options={"steps": 1, "heartbeat_for": 14}))
    run = daemon.wait_run(run_id, timeout=60)
    assert run["state"] == "succeeded", run
    assert _attempt(run)["duration"] > 14


@pytest.mark.parametrize("where", ["rank", "config"])
def test_a_phase_over_its_budget_is_stalled_naming_phase_budget_and_evidence(daemon, where):
    # Its evidence moves the whole time: only the budget can end it.
    options = {"steps": 1, "heartbeat_for": 120}
    stages_extra = {}
    if where == "rank":
        options["phase_budget"] = 4
    else:
        options["phase_budget"] = 500  # the rank's own, which the run's config overrides
        stages_extra = {"phase_budgets": {"load": 4}}
    toml = run_toml(
        f"budget-{where}",
        ["selftest"],
        resources={"ranks": 1, "devices": "cpu"},
        stages={"selftest": {"stall_timeout": 60, "options": options, **stages_extra}},
    )
    run_id = daemon.submit(toml)
    run = daemon.wait_run(run_id, timeout=60)
    attempt = _attempt(run)
    root = attempt["root_cause"]
    assert (run["state"], root["type"], root["rank"]) == ("failed", "Stalled", 0), root
    took = float(root["message"].split("has run ")[1].split(" s")[0])
    print(f"budget 4 s ({where}): found after {took:g} s of the phase")
    assert 4 <= took <= 4 + SLACK, root["message"]
    assert root["message"].startswith(
        f"rank 0's phase 'selftest heartbeat_for' has run {took:.0f} s, over its budget of 4 s "
        '(stages.selftest.phase_budgets.load sets it); its last evidence {"ticks": '
    ), root["message"]
    assert attempt["duration"] <= 4 + SLACK + 5


def test_a_stopped_child_of_a_rank_is_named_as_the_cause(daemon):
    """The seed's 18-minute phase, in small: the rank waits for its engine process; the engine is
    stopped. The rank's heartbeat thread beats on; the stopped process is named, by pid, what
    it is and its state, within the stall bound."""
    run_id = daemon.submit(
        selftest_toml(
            "stopped-engine",
            ranks=1,
            stall_timeout=10,
            options={"steps": 1, "heartbeat_for": 300, "heartbeat_evidence": "child"},
        )
    )
    child = _child_pid(daemon, run_id)
    wait_for(lambda: psutil.Process(child).cpu_times().user > 0.5, what="the engine stand-in working")
    stopped_at = time.time()  # before the signal: a loaded machine may pause this process after it
    os.kill(child, signal.SIGSTOP)
    run = daemon.wait_run(run_id, timeout=10 + 40)
    attempt = _attempt(run)
    root = attempt["root_cause"]
    found = root["time"] - stopped_at
    print(f"stopped engine stand-in found {found:.1f} s after SIGSTOP (stall_timeout 10)")
    assert (run["state"], root["type"], root["pid"], root["rank"]) == ("failed", "Stalled", child, 0), root
    # From its last sign of life: the CPU it burnt, seen moving each second up to the stop.
    assert 10 - 2 <= found <= 10 + SLACK, found
    assert root["message"].startswith(
        f"selftest::EngineCore under rank 0 (pid {child}) has been stopped (SIGSTOP or a debugger holds it) for "
    ), root["message"]
    assert "the ranks waiting for it are not the cause" in root["message"]
    tb = root["traceback"]
    # The table of every process first, then the stopped one's block, before the rank's.
    assert tb.startswith("the group's processes when it was found stuck:\n"), tb
    assert f"selftest::EngineCore under rank 0 (pid {child}): stopped (SIGSTOP or a debugger holds it) for " in tb
    block = tb.split("\n\n", 1)[1]
    assert block.startswith(f"selftest::EngineCore under rank 0 (pid {child}):\nstate: stopped"), block
    assert "no native stacks: it is stopped" in block
    assert "rank 0 (pid " in block and "_silent_phase" in block  # the waiting rank's own stacks follow
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_a_stopped_rank_among_working_peers_is_the_root_cause(daemon):
    run_id = daemon.submit(
        selftest_toml("stopped-rank", ranks=2, stall_timeout=8, options={"steps": 400, "step_time": 0.25})
    )
    ranks = wait_for(lambda: len(r := daemon.ranks(run_id)) == 2 and all(x["pid"] for x in r) and r, what="2 pids")
    victim = next(r for r in ranks if r["rank"] == 1)["pid"]
    time.sleep(1.0)  # a few steps first
    os.kill(victim, signal.SIGSTOP)
    run = daemon.wait_run(run_id, timeout=8 + 40)
    root = _attempt(run)["root_cause"]
    assert (root["type"], root["rank"], root["pid"]) == ("Stalled", 1, victim), root
    assert root["message"].startswith(f"rank 1 (pid {victim}) has been stopped (SIGSTOP or a debugger holds it) for ")
    assert "(no Python stacks: it is stopped, and writes its dump only once continued)" in root["traceback"]


def test_eyas_stacks_covers_every_process_under_a_rank_with_its_state(daemon):
    run_id = daemon.submit(
        selftest_toml(
            "stacks-tree",
            ranks=1,
            stall_timeout=0,
            options={"steps": 1, "heartbeat_for": 120, "heartbeat_evidence": "child"},
        )
    )
    child = _child_pid(daemon, run_id)
    time.sleep(2.5)  # two samples: the watch knows the child
    out = daemon.cli("stacks", str(run_id), timeout=60)
    daemon.request("stop", run=run_id)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"selftest::EngineCore under rank 0 (pid {child}):" in text, text
    assert "state: running for " in text, text
    daemon.wait_run(run_id, timeout=30)
