"""The straggler rule: a driver rank still alive `exit_timeout` seconds after its own work ended,
or after every peer rank exited 0, is stuck, and this module says which and writes the
root-cause error.

A rank can finish its work and then never exit: a ProcessGroupGloo destructor that waits, under
the GIL, for a thread that needs the GIL; a non-daemon thread left running; an atexit hook
blocked on a dead peer. Nothing is written any more, but the stall rule may be set far above
this (a real stage's is ten minutes, for weight loads) or off. The runtime writes
`rank-<r>.done.json` ({"pid", "time", "exit_code"}) when the stage function has returned and its
files are closed, then ends with os._exit, so a live rank whose done.json is `exit_timeout`
seconds old has hung on its way out. A rank without one whose peers all exited 0 that long ago
is stuck too: data-parallel ranks finish together. `[stages.<name>] exit_timeout` sets the bound
(the stage spec's default when unset, 0 turns it off). The watchdog (daemon/watchdog.py) then
collects the stacks and tears the group down; the root cause is "Straggler", with the rank's
native and Python stacks as its traceback.
"""

from __future__ import annotations

from eyas.state import contract
from eyas.wire.stacks import report


def check(group, now: float) -> dict | None:
    """The first driver rank that should have exited `group.exit_timeout` seconds ago:
    {"kind": "straggler", "time", "rank", "pid", "after"}; None when there is none."""
    for r in group.ranks:
        if r.exit is not None or r.role == "tp-worker":
            continue
        since = []
        done = group.own_record(contract.rank_file(r.rank, contract.DONE), {r.pid}, pid_unknown=r.pid is None)
        if done is not None and done.get("time") is not None:
            since.append((float(done["time"]), "its stage function returned"))
        peers = [p for p in group.ranks if p is not r]
        if peers and all(p.exit is not None and not p.exit.failed for p in peers):
            since.append((max(p.exit.time for p in peers), "its peers finished"))
        if since and now - min(since)[0] >= group.exit_timeout:
            return {
                "kind": "straggler",
                "time": now,
                "rank": r.rank,
                "pid": r.pid,
                "after": min(since)[1],
                "processes": group.vitals.table(now),  # every live process and its state (daemon/phases.py)
            }
    return None


def error_record(group, host: str) -> contract.ErrorRecord:
    """The error of a straggling rank (a daemon.group.Group whose `stuck` is a straggler)."""
    stuck = group.stuck
    asked = stuck.get("asked", [])
    mine = next((a for a in asked if a.get("rank") == stuck["rank"] and a.get("role") != "tp-worker"), None)
    rank = group.ranks[stuck["rank"]]
    return contract.ErrorRecord(
        rank=stuck["rank"],
        pid=stuck["pid"],
        host=host,
        type="Straggler",
        message=(
            f"rank {stuck['rank']} did not exit {group.exit_timeout:g} s after {stuck['after']} "
            f"(stages.{group.stage}.exit_timeout = {group.exit_timeout:g}); its stacks follow"
        ),
        traceback=(
            f"the group's processes when it was found stuck:\n{stuck['processes']}\n\n"
            if stuck.get("processes")
            else ""
        )
        + report(asked, mine),
        time=stuck["time"],
        source="straggler",
        path=str(rank.log_path),
    )
