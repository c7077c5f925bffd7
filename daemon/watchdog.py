"""The hang watchdog: an attempt that is stuck (its ranks all quiet, daemon/stall.py, or a rank
outliving its work, daemon/straggler.py) fails, with every live process's stacks as the cause.

Both rules are on by default (the stage spec's stall_timeout and exit_timeout). Once one fires,
the group's `stuck` record is set, every live process's Python and native stacks are collected
(daemon/stacks.py, daemon/native.py) off the event loop, and then the group is torn down; it is
settled only after that, with the stuck record's error as the root cause and max_restarts
applying as to any failure.
"""

from __future__ import annotations

import logging

from . import stall, straggler

log = logging.getLogger("eyas.daemon.watchdog")

_RULES = {"straggler": straggler, "stall": stall}


def check(groups, now: float) -> list:
    """The groups (daemon.group.Group) found stuck on this look, each with its `stuck` record
    set (so they count as collecting); the caller reports them and runs end() for each."""
    found = []
    by_stage = {(g.run_id, g.stage): g for g in groups}
    for group in groups:
        if group.stuck is not None or group.teardown_since is not None:
            continue
        # The straggler rule first: it is the more precise of the two when both apply.
        stuck = (
            (group.exit_timeout > 0 and straggler.check(group, now))
            or (
                group.stall_timeout > 0
                and stall.check(group, now, lambda stage, g=group: by_stage.get((g.run_id, stage)))
            )
            or None
        )
        if stuck is not None:
            group.stuck = stuck  # settled only once its stacks are in ("asked")
            found.append(group)
    return found


def summary(group) -> str:
    """What the daemon is doing about a stuck group, for its log and the stage's events."""
    stuck = group.stuck
    if stuck["kind"] == "stall" and stuck.get("cause") == "process":
        what = f"stalled: {stuck['who']} {stuck['state']} for {stuck['held']:.0f} s"
    elif stuck["kind"] == "stall" and stuck.get("cause") == "budget":
        what = (
            f"stalled: rank {stuck['rank']}'s phase {stuck['phase']['phase']!r} over its {stuck['budget']:.0f} s budget"
        )
    elif stuck["kind"] == "stall":
        what = f"stalled: no sign of life for {stuck['quiet']:.0f} s"
    else:
        what = f"straggler: rank {stuck['rank']} still alive {group.exit_timeout:g} s after {stuck['after']}"
    return f"{what}; collecting stacks, then tearing down"


async def end(group, grace: float, recorded=lambda group: None) -> None:
    """Collect the stuck group's stacks, then tear it down (unless a teardown began meanwhile).
    `recorded(group)` makes the finding durable with its stacks before the first signal."""
    try:
        group.stuck["asked"] = await group.collect_stacks([*group.ranks, *group.workers.values()], descendants=True)
    except Exception:
        # A failed dump must not leave the hang in place: tear down without the stacks.
        log.exception("run %s: %s attempt %d: collecting stacks failed", group.run_id, group.stage, group.attempt)
    finally:
        group.stuck.setdefault("asked", [])  # collected, or given up on
    recorded(group)
    if group.teardown_since is None:
        await group.teardown(grace, group.stuck["kind"])


def record(group, host: str):
    """The root-cause error of a stuck group being settled; None when it was not stuck (or
    the user or the daemon's shutdown cancelled it, which says more)."""
    if group.stuck is None or group.cancel_reason is not None:
        return None
    return _RULES[group.stuck["kind"]].error_record(group, host)
