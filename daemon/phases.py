"""What the watchdog knows of a live group beyond its files: every process under its ranks with its
state and how long it has been in it, each rank's open phase with its budget and evidence, and when
each last showed life; and the three findings drawn from them (daemon/stall.py reports them).

A heartbeat says which phase a rank is in; it is not proof of life, because the thread that beats
runs on while the phase it reports on hangs (a stopped engine process, a deadlocked load). So a
rank is alive while it writes (its log, a progress record) or while its open phase's evidence
moves: the counters its heartbeats carry (workers/runtime/phases.py: bytes read, files written),
and, measured here from /proc, the CPU time of the group's processes (an engine loading weights
in a child process writes nothing the rank could count). CPU counts only inside a phase: outside
one, a rank spinning in a collective whose peer is gone must still go quiet. A rank waiting for
its streaming sibling (`waits`) is as alive as that sibling.

The findings, each a Stalled root cause:
- "process": a process of the group stopped (SIGSTOP, a debugger) or in uninterruptible disk
  wait for the stage's stall_timeout: nothing of the group can move past it;
- "budget": a phase older than its budget (the rank's, derived from its work, or the run's
  `[stages.<name>] phase_budgets` for its kind);
- "quiet": no sign of life from any rank for stall_timeout (daemon/stall.py, as before phases
  had evidence).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .ranks import read_json

# CPU seconds the group's processes must add for a phase to count as working: an idle driver
# polling its engine's socket, with a heartbeat thread, adds a few ms a minute; a load or a
# compilation adds a core's worth.
CPU_MOVE_S = 1.0
# States in which a process makes no progress of its own and holds up whoever waits for it
# (psutil's names for /proc's T, t and D).
HELD = {"stopped": "stopped (SIGSTOP or a debugger holds it)", "tracing-stop": "stopped by a tracer"}
DISK_WAIT = {"disk-sleep": "in uninterruptible disk wait (D): blocked in the kernel on I/O"}
STUCK_STATES = {**HELD, **DISK_WAIT}


@dataclass
class Proc:
    """One live process of a group, as last sampled."""

    pid: int
    create_time: float
    rank: int  # the member whose tree it is in (a TP worker: world_size + its TP rank)
    role: str  # "rank", "monitor", "tp-worker" or "descendant"
    label: str  # how a person names it: "rank 1", "TP worker 0", "VLLM::EngineCore under rank 0"
    title: str
    state: str  # psutil's status name
    since: float  # when it was first seen in this state
    cpu: float  # CPU seconds, user and system

    def who(self) -> str:
        return f"{self.label} (pid {self.pid})"


@dataclass
class Watch:
    """The group's processes and phases, updated from each 1 Hz sample (daemon/metrics.py)."""

    procs: dict[int, Proc] = field(default_factory=dict)
    phases: dict[int, dict] = field(default_factory=dict)  # member number -> its open phase
    life: dict[int, float] = field(default_factory=dict)  # member number -> when it last showed life
    held_gone: dict[int, Proc] = field(default_factory=dict)  # processes last seen held, since gone
    cpu_mark: float | None = None  # the group's CPU total when it last moved by CPU_MOVE_S
    cpu_moved_at: float | None = None

    def update(
        self, group, member: int, procs: list[dict] | None, phase: dict | None, life: float | None, now: float
    ) -> None:
        """Take one member's sample: its processes (None: not known here, kept as they were),
        its open phase and its last sign of life."""
        if phase is None:
            self.phases.pop(member, None)
        else:
            self.phases[member] = phase
        if life is not None:
            self.life[member] = life
        if procs is not None:
            self.update_procs(group, member, procs, now)

    def update_procs(self, group, member: int, procs: list[dict], now: float) -> None:
        """Take one member's live processes ({"pid", "create_time", "state", "cpu", "title"},
        and "since" where a node's monitor measured it)."""
        roles = _roles(group)
        owner = _owner(group, member)
        seen = set()
        for p in procs:
            pid = p["pid"]
            seen.add(pid)
            old = self.procs.get(pid)
            state = p["state"]
            since = old.since if old is not None and old.state == state and old.create_time == p["create_time"] else now
            title = p.get("title") or "?"
            role, label = roles.get(pid, ("descendant", f"{title.split(' ')[0]} under {owner}"))
            self.procs[pid] = Proc(
                pid,
                p["create_time"],
                member,
                role,
                label,
                title,
                state,
                float(p.get("since") or since),
                float(p.get("cpu") or 0.0),
            )
        for pid in [pid for pid, q in self.procs.items() if q.rank == member and pid not in seen]:
            gone = self.procs.pop(pid)
            if gone.state in STUCK_STATES:
                self.held_gone[pid] = gone  # for the settlement: it may be the cause (daemon/failures.py)

    def settle_cpu(self, now: float) -> None:
        """After a whole sample: note when the group's CPU total last moved by CPU_MOVE_S."""
        total = sum(p.cpu for p in self.procs.values())
        if self.cpu_mark is None or total < self.cpu_mark or total - self.cpu_mark >= CPU_MOVE_S:
            self.cpu_mark, self.cpu_moved_at = total, now

    def alive_at(self, sibling_alive=lambda stage: None) -> float | None:
        """When the group last showed life: a rank's write or phase evidence, the CPU of its
        processes while a phase is open, or a waited-for sibling's own life."""
        times = list(self.life.values())
        if self.phases and self.cpu_moved_at is not None:
            times.append(self.cpu_moved_at)
        for phase in self.phases.values():
            if phase.get("waits"):
                times.append(sibling_alive(phase["waits"]))
        return max((t for t in times if t is not None), default=None)

    def stuck_process(self, now: float, bound: float) -> Proc | None:
        """The process held longest in a stuck state, once it has been so for `bound` seconds;
        a rank of eyas's before a descendant (it is what the user can name)."""
        held = [p for p in self.procs.values() if p.state in STUCK_STATES and now - p.since >= bound]
        return min(held, key=lambda p: (p.since, p.role == "descendant"), default=None)

    def over_budget(self, now: float, budgets: dict[str, float]) -> tuple[int, dict, float] | None:
        """(member, phase, budget) of the first open phase older than its budget: the run's for
        its kind where set (0: none), else the rank's own."""
        for member, phase in sorted(self.phases.items()):
            budget = budgets.get(phase.get("kind") or "other", phase.get("budget"))
            if budget and now - float(phase["since"]) > budget:
                return member, phase, float(budget)
        return None

    def table(self, now: float) -> str:
        """Every live process of the group, one line each: who, state and for how long, CPU."""
        lines = []
        for p in sorted(self.procs.values(), key=lambda p: (p.rank, p.role != "rank", p.pid)):
            state = STUCK_STATES.get(p.state, p.state)
            lines.append(f"  {p.who()}: {state} for {now - p.since:.0f} s, cpu {p.cpu:.1f} s  [{p.title[:80]}]")
        return "\n".join(lines)


def node_tree(path, now: float) -> list[dict] | None:
    """A remote rank's processes from its monitor's tree.json (workers/runtime/tree.py), each
    with "since" on this host's clock (the node wrote durations); None before it wrote one."""
    record = read_json(path)
    if not isinstance(record, dict) or not isinstance(record.get("procs"), list):
        return None
    out = []
    for p in record["procs"]:
        if isinstance(p, dict) and isinstance(p.get("pid"), int) and isinstance(p.get("state"), str):
            out.append({**p, "since": now - float(p.get("for") or 0.0)})
    return out


def _roles(group) -> dict[int, tuple[str, str]]:
    """pid -> (role, label) of the processes eyas itself knows: ranks, their monitors, TP workers."""
    roles: dict[int, tuple[str, str]] = {}
    for r in group.ranks:
        if r.monitor_pid:
            roles[r.monitor_pid] = ("monitor", f"rank {r.rank}'s monitor")
        if r.pid:
            roles[r.pid] = ("rank", f"rank {r.rank}")
    for k, w in group.workers.items():
        if w.pid:
            roles[w.pid] = ("tp-worker", f"TP worker {k}")
    return roles


def _owner(group, member: int) -> str:
    return f"rank {member}" if member < group.world_size else f"TP worker {member - group.world_size}"


def wchan(pid: int) -> str | None:
    """The kernel function a sleeping process waits in (/proc/<pid>/wchan), where it says one."""
    try:
        with open(f"/proc/{pid}/wchan") as f:  # noqa: PTH123
            name = f.read().strip()
    except OSError:
        return None
    return name if name and name != "0" else None


def describe(p: Proc, now: float) -> dict:
    """What a stacks entry says of a process's state (wire/stacks.py renders it)."""
    out = {"state": p.state, "state_for": round(now - p.since, 1), "cpu": p.cpu, "title": p.title}
    if p.state in STUCK_STATES:
        where = wchan(p.pid)
        if where:
            out["wchan"] = where
    return out
