"""The stall rule: a stage whose ranks show no life for its stall_timeout, one of whose processes
is stopped or stuck in the kernel that long, or whose phase outlives its budget, is stuck; this
module says when, and writes the root-cause error.

A rank stuck in a collective, a rendezvous or a deadlocked engine neither exits nor raises; left
alone it holds the GPUs until a two-hour collective timeout, or for ever. The daemon watches the
attempt directory (every rank's log and records live there) and what the sampler learns of the
group (daemon/phases.py: every process under the ranks with its state, each rank's open phase and
its evidence). The group is stuck, for the watchdog (daemon/watchdog.py) to collect every live
process's stacks and tear it down as failed, when for `[stages.<name>] stall_timeout` seconds (the
stage spec's default when unset; 0 turns the rule off):
- no rank wrote a log line, a progress record or a file, and no open phase's evidence moved
  ("quiet"): a heartbeat alone is no sign of life, since the thread that writes it runs on
  while the phase it reports on hangs;
- or one process of the group, a rank or anything under it (vLLM's EngineCore, a TP worker), was
  stopped or in uninterruptible disk wait ("process"): it is the root cause, not the peers
  that wait for it;
- or, at any time, a rank's open phase has run past its budget ("budget").
The root-cause error is "Stalled", its message names what was found, its traceback every live
process's state and stacks, and max_restarts applies as to any failure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eyas.state import contract
from eyas.wire.stacks import report

from . import phases
from .ranks import tail_text


def activity(directory: Path) -> tuple:
    """What the ranks have written so far: (name, size, mtime) of every file in the attempt
    directory but the progress files, whose heartbeats would make a hung phase look busy (the
    sampler reads what they say: daemon/phases.py)."""
    try:
        with os.scandir(directory) as it:
            return tuple(
                sorted(
                    (e.name, s.st_size, s.st_mtime_ns)
                    for e in it
                    if e.is_file() and not e.name.endswith(contract.PROGRESS)
                    for s in (e.stat(),)
                )
            )
    except OSError:
        return ()


# Seconds after the group's last sign of life within which a process seen held (stopped, or in
# D) counts as what the group went quiet for.
QUIET_HELD_SLACK_S = 5.0


def check(group, now: float, sibling=lambda stage: None) -> dict | None:
    """The group's stall (see the module's docstring): {"kind": "stall", "cause", "time",
    "quiet", "heartbeat", ...the cause's fields}; None while it is not stuck. `sibling(stage)`
    is the live group of the run's other stage of that name, or None."""
    seen = activity(group.dir)
    if seen != group.activity:
        group.activity, group.active_at = seen, now
    watch = group.vitals
    alive = watch.alive_at(lambda stage: _alive(sibling(stage)))
    last = max(group.active_at, alive or 0.0)
    found: dict = {"kind": "stall", "time": now, "quiet": now - last}
    held = watch.stuck_process(now, group.stall_timeout)
    if held is None and now - last >= group.stall_timeout:
        # Quiet, and a process was held from about when the quiet began: that is why (its
        # state is sampled once a second, after the last write it may have made).
        held = watch.stuck_process(now, max(0.0, now - last - QUIET_HELD_SLACK_S))
    if held is not None:
        found.update(
            cause="process", pid=held.pid, who=held.who(), state=held.state, held=now - held.since, since=held.since
        )
    elif (over := watch.over_budget(now, group.phase_budgets)) is not None:
        member, phase, budget = over
        found.update(cause="budget", rank=member, phase=phase, budget=budget)
    elif now - last >= group.stall_timeout:
        found.update(cause="quiet")
    else:
        return None
    # The last heartbeat names the phase the ranks were stuck in, if that phase was still open.
    beat = last_heartbeat(group.dir)
    if beat is not None and beat["phase"] in {p.get("phase") for p in watch.phases.values()}:
        found["heartbeat"] = beat
    found["processes"] = watch.table(now)
    return found


def _alive(group) -> float | None:
    """When a waited-for sibling group last showed life; None when it is not live, or stuck."""
    if group is None or group.stuck is not None:
        return None
    return max(group.active_at, group.vitals.alive_at() or 0.0)


def last_heartbeat(directory: Path) -> dict | None:
    """The newest heartbeat line of any progress file: {"phase", "time", "file"}, or None."""
    best = None
    for path in directory.glob(contract.PROGRESS_GLOB):
        for line in reversed(tail_text(path).splitlines()):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("heartbeat"):
                if best is None or float(rec.get("time") or 0) > best["time"]:
                    best = {
                        "phase": str(rec["heartbeat"]),
                        "time": float(rec.get("time") or 0),
                        "file": path.name.split(".")[0],
                    }
                break
    return best


def error_record(group, host: str) -> contract.ErrorRecord:
    """The root-cause error of a stalled attempt (a daemon.group.Group whose `stuck` is a stall):
    the stuck process, else the rank whose phase is over its budget, else a stopped or blocked
    process, else the first live rank that wrote its stacks, leads the report."""
    stuck = group.stuck
    asked = stuck.get("asked", [])
    live = [a for a in asked if a.get("skipped") != "not running"]
    cause = stuck.get("cause", "quiet")
    if cause == "process":
        first = next((a for a in live if a.get("pid") == stuck["pid"]), None)
    elif cause == "budget":
        first = next((a for a in live if a.get("rank") == stuck["rank"] and a.get("role") != "descendant"), None)
    else:
        first = next((a for a in live if a.get("state") in phases.STUCK_STATES), None)
    first = first or next((a for a in live if "offset" in a), live[0] if live else asked[0] if asked else {})
    processes = stuck.get("processes")
    table = f"the group's processes when it was found stuck:\n{processes}\n\n" if processes else ""
    return contract.ErrorRecord(
        rank=first.get("rank"),
        pid=stuck.get("pid") if cause == "process" else first.get("pid"),
        host=host,
        type="Stalled",
        message=_message(group, stuck),
        traceback=table + report(asked, first or None),
        time=stuck["time"],
        source="stall",
        path=first.get("log_path"),
    )


def _message(group, stuck: dict) -> str:
    bound = f"stages.{group.stage}.stall_timeout = {group.stall_timeout:g}"
    cause = stuck.get("cause", "quiet")
    if cause == "process":
        state = phases.STUCK_STATES.get(stuck["state"], stuck["state"])
        return (
            f"{stuck['who']} has been {state} for {stuck['held']:.0f} s ({bound}){_during(group, stuck)}; "
            "the ranks waiting for it are not the cause. Every live process's state and stacks follow"
        )
    if cause == "budget":
        phase, budget = stuck["phase"], stuck["budget"]
        kind = phase.get("kind") or "other"
        took = stuck["time"] - float(phase["since"])
        return (
            f"rank {stuck['rank']}'s phase {phase['phase']!r} has run {took:.0f} s, over its budget of {budget:.0f} s "
            f"(stages.{group.stage}.phase_budgets.{kind} sets it); {_evidence(phase, stuck['time'])}; "
            "every live process's state and stacks follow"
        )
    return (
        f"no rank wrote a log line or progress, and no phase's evidence moved, for {stuck['quiet']:.0f} s "
        f"({bound}){_during(group, stuck)}; the live ranks' stacks follow"
    )


def _during(group, stuck: dict) -> str:
    """Which open phase the ranks were in, by their last heartbeat (which proves nothing else)."""
    beat = stuck.get("heartbeat")
    if not beat:
        return ""
    return (
        f"; {beat['file'].replace('-', ' ')} was in its phase {beat['phase']!r} "
        f"(its last heartbeat {stuck['time'] - beat['time']:.0f} s before)"
    )


def _evidence(phase: dict, now: float) -> str:
    evidence = phase.get("evidence")
    moved = now - float(phase.get("evidence_at") or phase["since"])
    if evidence:
        return f"its last evidence {json.dumps(evidence, sort_keys=True)} moved {moved:.0f} s before"
    return f"it reported no evidence of its own; it last showed life {moved:.0f} s before"
