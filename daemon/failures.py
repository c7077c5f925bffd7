"""How a root cause is chosen, in one place: which exits are a rank's own failure, their order (the first is the root cause), and the error record each one becomes.

The rules, in order:
- a rank's failure is its own only if it came before eyas began tearing the group down (a
  signal eyas sent, or an error raised because of it, is a consequence, never a cause);
- the earliest failure is the root cause, by the time of its exception where it raised one,
  else of its exit; a TP worker's error, written inside the worker before vLLM flattens it
  into `Worker failed with error ''` for the driver, therefore wins over the driver's;
- one exception to time order: a peer's lost-connection error just before a death by signal
  is that death's consequence, and the death goes first;
- the watchdog's finding (daemon/watchdog.py) leads when it found a stall (the ranks' own
  failures came after the daemon gave up on them); a straggler's record is ordered by time;
- a process of the group that was stopped (SIGSTOP, a debugger) or in uninterruptible disk wait
  (D) from before the first failure, for at least HELD_MIN_S, is the root cause over the peers
  that failed waiting for it (a collective's timeout, a lost heartbeat), the way a collective's
  straggler causes its peers' timeouts: a process that cannot run cannot answer, while its
  peers' errors only say that it did not. The state comes from the watch (daemon/phases.py),
  sampled each second; within a stall the watchdog's own finding names that process already
  (daemon/stall.py: a stuck process is preferred over the ranks that wait for it);
- a rank whose exit or error file is missing because the state directory was full is named
  for that (ENOSPC), not as a plain exit code or a lost rank;
- no record is ever empty: an exception keeps its type and traceback even with an empty
  message; a death by signal names the signal, and an OOM kill says so.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from eyas.state import contract, procs
from eyas.state.contract import ErrorRecord

from .ranks import RankExit, log_tail

if TYPE_CHECKING:
    from .group import Group


def who(ex: RankExit) -> str:
    return f"TP rank {ex.tp_rank}" if ex.tp_rank is not None else f"rank {ex.rank}"


def exit_text(ex: RankExit) -> str:
    who_ = who(ex)
    if ex.lost:
        return f"{who_} lost"
    if ex.signal is not None:
        return f"{who_} killed by {ex.signal_name}" + (" (OOM)" if ex.oom_killed else "")
    if ex.error is not None:
        return f"{who_} raised {ex.error.get('type')}"
    if ex.tp_rank is not None and not ex.unexpected:
        return f"{who_} ended with its engine"
    return f"{who_} exited with code {ex.exit_code}"


# How long after a peer's lost-connection error a death by signal still counts as its cause.
PEER_LOSS_WINDOW = 1.0


# What gloo, NCCL and torch.distributed say when the other end of a collective went away.
_PEER_LOSS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|DistBackendError|"
    r"DistNetworkError|remote process exited|NCCL communicator was aborted",
    re.IGNORECASE,
)


def _failure_time(ex: RankExit) -> float:
    """When a failure happened: its exception's own time if it raised one, else its exit."""
    return float((ex.error or {}).get("time") or ex.time)


def _is_peer_loss(error: dict) -> bool:
    return bool(_PEER_LOSS.search(f"{error.get('type', '')}: {error.get('message', '')}"))


def counts_as_failure(group: Group, ex: RankExit) -> bool:
    """A rank's own failure, as opposed to the signal eyas sent it while tearing down."""
    if not ex.failed:
        return False
    if group.teardown_since is None:
        return True
    if ex.error is not None:
        return float(ex.error.get("time") or ex.time) < group.teardown_since
    # Seen to end before the teardown began: the rank's own doing, whatever the cause (a
    # bare exit code counts too: a rank that could not write its error file on a full
    # disk is often what started the teardown, and must not be forgotten at settlement).
    return ex.time < group.teardown_since


def failures(group: Group) -> list[RankExit]:
    """The ranks' own failures, earliest first: the first one is the root cause.

    One exception to time order: a peer's lost-connection error just before a death by
    signal is that death's consequence. A death's time is when its monitor's waitpid
    returned, a few ms after the kernel closed the dead rank's sockets, and the
    survivors' collective library reports the closed socket at once, so the effect can
    be stamped before its cause.
    """
    members = list(group.ranks) + [group.workers[k] for k in sorted(group.workers)]
    found = [r.exit for r in members if r.exit is not None and group.counts_as_failure(r.exit)]
    found.sort(key=lambda e: (_failure_time(e), e.rank))
    if found and found[0].error is not None and _is_peer_loss(found[0].error):
        first = _failure_time(found[0])
        for i, e in enumerate(found):
            if e.error is None and e.signal is not None and _failure_time(e) - first <= PEER_LOSS_WINDOW:
                found.insert(0, found.pop(i))
                break
    return found


def describe_failure(group: Group, ex: RankExit, host: str) -> contract.ErrorRecord:
    """The error record of one failed rank. Never empty: an exception keeps its type and
    traceback even with an empty message; a signal death names the signal."""
    rank = group.rank_of(ex.rank)
    host = rank.host or host  # a Slurm rank's node
    tp = {"role": "tp-worker", "tp_rank": ex.tp_rank} if ex.tp_rank is not None else {}
    if ex.error is not None:
        e = ex.error
        path = (
            contract.tp_file(ex.tp_rank, contract.ERROR)
            if ex.tp_rank is not None
            else contract.rank_file(ex.rank, contract.ERROR)
        )
        return contract.ErrorRecord(
            rank=ex.rank,
            pid=e.get("pid", ex.pid),
            host=e.get("host", host),
            type=e.get("type") or "Exception",
            message=e.get("message") or "",
            traceback=e.get("traceback") or log_tail(rank.log_path),
            time=float(e.get("time") or ex.time),
            source="exception",
            path=str(group.dir / path),
            final=bool(e.get("final")),
            **tp,
        )
    tail = log_tail(rank.log_path)
    if ex.tp_rank is not None:
        if ex.signal is not None:
            kind, how = ex.signal_name, f"was killed by {ex.signal_name} (signal {ex.signal})"
        elif ex.exit_code is not None:
            kind, how = "ExitCode", f"exited with code {ex.exit_code}"
        else:
            kind, how = "WorkerDied", "ended (its exit status was not known yet when vLLM looked)"
        return contract.ErrorRecord(
            rank=ex.rank,
            pid=ex.pid,
            host=host,
            type=kind,
            message=f"TP rank {ex.tp_rank} (pid {ex.pid}) {how}: vLLM's executor reported that it died unexpectedly",
            traceback=tail,
            time=ex.time,
            source="signal" if ex.signal else "exit",
            path=str(rank.log_path),
            **tp,
        )
    if ex.lost:
        kind, msg, source = (
            "Lost",
            (f"rank {ex.rank} (pid {ex.pid}) ended while the daemon was down and left no exit record"),
            "lost",
        )
    elif ex.signal is not None:
        kind = ex.signal_name
        msg = f"rank {ex.rank} (pid {ex.pid}) was killed by {kind} (signal {ex.signal})"
        if ex.oom_killed:
            msg += ": the kernel's OOM killer ended it (out of memory)"
        source = "signal"
    else:
        kind, msg, source = (
            "ExitCode",
            (f"rank {ex.rank} (pid {ex.pid}) exited with code {ex.exit_code} without a Python exception"),
            "exit",
        )
    return contract.ErrorRecord(
        rank=ex.rank,
        pid=ex.pid,
        host=host,
        type=kind,
        message=msg,
        traceback=tail,
        time=ex.time,
        source=source,
        path=str(rank.log_path),
    )


# Seconds a process must have been held (stopped, or in D) before a failure to be its cause: a
# moment's D state (a page fault on a busy disk) or a debugger's brief attach is no cause.
HELD_MIN_S = 2.0


def held_record(group: Group, host: str, before: float) -> ErrorRecord | None:
    """The error record of a process held stopped or in disk wait since before `before`, if any."""
    from .phases import STUCK_STATES  # the watch's own names for the states

    seen = [*group.vitals.procs.values(), *group.vitals.held_gone.values()]
    held = [p for p in seen if p.state in STUCK_STATES and p.since <= before - HELD_MIN_S]
    if not held:
        return None
    p = min(held, key=lambda p: (p.since, p.role == "descendant"))
    rank = group.rank_of(p.rank) if p.rank < len(group.ranks) + len(group.workers) else None
    return contract.ErrorRecord(
        rank=p.rank,
        pid=p.pid,
        host=host,
        type="Stopped" if p.state != "disk-sleep" else "DiskWait",
        message=(
            f"{p.who()} was {STUCK_STATES[p.state]} from {before - p.since:.0f} s before the first failure; "
            "its peers' failures followed from waiting for it"
        ),
        traceback=group.vitals.table(before),
        time=p.since,
        source="stall",
        path=str(rank.log_path) if rank is not None else None,
    )


def ordered(group: Group, host: str, stuck: ErrorRecord | None) -> list[tuple[RankExit | None, ErrorRecord]]:
    """The group's failures as (whose, error record), root cause first; `stuck` is the
    watchdog's record (None: it found nothing), whose entry has no rank exit."""
    records = [(ex, describe_failure(group, ex, host)) for ex in failures(group)]
    if records and stuck is None:
        held = held_record(group, host, records[0][1].time)
        if held is not None:
            records.insert(0, (None, held))
    if stuck is not None and group.stuck["kind"] == "stall":
        # The ranks' own failures, if any, came after the daemon gave up on them.
        records.insert(0, (None, stuck))
    elif stuck is not None:
        # A straggler's own exception, raised before it hung on its way out, stays the cause.
        records = sorted([*records, (None, stuck)], key=lambda pair: pair[1].time)
    return records


def as_recorded(core, group: Group, ex: RankExit | None, rec: ErrorRecord) -> ErrorRecord:
    """One failure's error record as it is written. A rank that raised because a disk was full
    is named for that (ENOSPC), with the file it could not write and its own traceback; a rank
    whose records are missing because the state directory was full says exactly that, never a
    plain exit code or a lost rank. Decided at each try: the settlement's own write may be what
    shows the disk full."""
    if ex is None or ex.signal is not None:
        return rec
    if ex.error is not None:
        full = _full_in(ex.error)
        return rec if full is None else _full_exception(core, ex, rec, full)
    if ex.tp_rank is not None or not _was_full(core, group):
        return rec
    return _records_missing(core, group, ex, rec)


# An OSError's text, where the record has no `disk_full` of the rank runtime's
# (workers/runtime/fulldisk.py): a vLLM TP worker's error file, an older rank's.
_FULL_TEXT = re.compile(r"\[Errno (28|122)\] (?:No space left on device|Disk quota exceeded)(?:: '(.+)')?")


def _full_in(error: dict) -> dict | None:
    """{"errno", "file" (None: not named)} when a rank's exception says a disk was full."""
    full = error.get("disk_full")
    if isinstance(full, dict):
        return {"errno": str(full.get("errno") or "ENOSPC"), "file": full.get("file") or None}
    last = (error.get("traceback") or "").rstrip().rpartition("\n")[2]
    for text in (str(error.get("message") or ""), last):
        m = _FULL_TEXT.search(text)
        if m:
            return {"errno": "EDQUOT" if m.group(1) == "122" else "ENOSPC", "file": m.group(2)}
    return None


def _full_exception(core, ex: RankExit, rec: ErrorRecord, full: dict) -> ErrorRecord:
    """The record of a rank that raised on a full disk: the file it was writing when the disk
    refused (the rank runtime names it: its log, a progress or record file, a shard), and its
    own traceback, which its error file kept (the rank writes it into blocks held from its
    start: workers/runtime/fulldisk.py), never the log's tail."""
    name, file = full["errno"], full["file"]
    what = f"{name} while writing {file}" if file else f"{name} while writing a file its exception does not name"
    if file and _under(file, core.home):
        what += f" (the state directory {core.home} was full)"
    raised = f"{rec.type}: {rec.message}" if rec.message else rec.type
    return rec.replace(type=name, source="disk_full", message=f"{what}; {who(ex)} (pid {rec.pid}) raised {raised}")


def _records_missing(core, group: Group, ex: RankExit, rec: ErrorRecord) -> ErrorRecord:
    """A rank that ended on a full state directory and left no error file (it could not write
    one, or did not raise) or no exit record: said as such. Its own error is not known, so
    the record points at its log (whose tail stands as the traceback), not at a missing file."""
    exit_name = contract.rank_file(ex.rank, contract.EXIT)
    error_name = contract.rank_file(ex.rank, contract.ERROR)
    missing = [n for n in (exit_name, error_name) if not (group.dir / n).exists()]
    if not missing:
        return rec
    how = f"exited with code {ex.exit_code}" if ex.exit_code is not None else "ended"
    lost = {
        exit_name: f"its exit record ({exit_name}) could not be written",
        error_name: f"no error file ({error_name}) was written, so its own error, if it raised one, is not known",
    }
    log_path = group.rank_of(ex.rank).log_path
    return rec.replace(
        type="ENOSPC",
        source="disk_full",
        path=str(log_path),
        message=f"rank {ex.rank} (pid {ex.pid}) {how} while the state directory {core.home} was full "
        f"(no space left on device): {'; '.join(lost[n] for n in missing)}",
        traceback=rec.traceback or log_tail(log_path),
    )


def _under(file: str, home) -> bool:
    # As spelt, without a look at the disk (this runs on the event loop): the rank's paths are
    # made from the attempt directory the daemon gave it, under the home as the daemon spells it.
    return home is not None and Path(file).is_relative_to(home)


def _was_full(core, group: Group) -> bool:
    disk = core.disk
    return (
        disk.full
        or (disk.seen_at is not None and disk.seen_at >= group.started_at - procs.CREATE_TIME_SLACK_S)
        or disk.low(group.dir)
    )
