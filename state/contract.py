"""The rank contract, in one place: the environment the daemon gives each rank process and the
files that ranks, their monitors and vLLM's TP workers leave in their attempt's directory.

Every producer (workers/runtime/rank.py, workers/runtime/monitor.py, workers/vllm/ext.py, the stages) and
every reader (the daemon's supervisor, settlement, sampler and watchdog; the CLI's logs; the
TUI) builds these names here, so that the two sides cannot drift apart. torchelastic keeps its
error-file contract the same way (`TORCHELASTIC_ERROR_FILE`, `ProcessFailure`).

An attempt's directory, `<state>/runs/<id>/<stage>/attempt-<n>/`, holds per rank r:
- `rank-<r>.log`             stdout and stderr of the rank (its monitor bounds it: state/logcut.py)
- `rank-<r>.cut.json`        where the log was cut, once it was (state/logcut.py)
- `rank-<r>.proc.json`       the monitor's and the rank's pids and start times, written at start
- `rank-<r>.progress.jsonl`  progress records the daemon samples (workers/runtime/progress.py)
- `rank-<r>.error.json`      the uncaught exception, written by the rank (or its monitor)
- `rank-<r>.done.json`       the stage function returned and its outputs are durable
- `rank-<r>.exit.json`       the exit status, written by the monitor after reaping the rank
- `rank-<r>.split.json`      how far the daemon split a vLLM driver's log by TP worker
- `rank-<r>.tree.json`       a Slurm rank's processes, states and CPU, as its monitor sees them
- `rank-<r>.native.json`     their native stacks, taken by that monitor when `eyas stacks` asks
and per TP worker k of a vLLM driver: `tp-<k>.proc.json` (its registration), `tp-<k>.log`,
`tp-<k>.error.json`, `tp-<k>.progress.jsonl`, with `driver.log` holding the driver's own
lines; and `summary.json`, the stage's figures, written by rank 0 last. The daemon's own file there
is `stop.json`: a stop it signalled before eyas.db could record it (daemon/intent.py).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

# -- the environment of a rank (torch.distributed's names, then eyas's) ---------------------------

RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RUN_ID = "EYAS_RUN_ID"
STAGE = "EYAS_STAGE"
ATTEMPT = "EYAS_ATTEMPT"
ATTEMPT_DIR = "EYAS_ATTEMPT_DIR"  # the directory this module's files live in
OUTPUT_DIR = "EYAS_OUTPUT_DIR"
CONFIG = "EYAS_CONFIG"  # the run's config.json (state/runconfig.py's to_dict)
LOG_MAX_MB = "EYAS_LOG_MAX_MB"  # the rank log's bound, for the monitor
# "1": the daemon cannot see this rank's processes (a Slurm task on its node: workers/runtime/
# slurm_task.py sets it), so the rank's side reports what the daemon would otherwise read itself.
REMOTE = "EYAS_REMOTE_RANK"
RANK_FINALIZE = "EYAS_RANK_FINALIZE"  # "1": end with Python's finalisation, not os._exit

# -- the files of an attempt ---------------------------------------------------------------------

# The rank monitor every rank runs as (workers/runtime/monitor.py), locally and as a Slurm task.
MONITOR_MODULE = "eyas.workers.runtime.monitor"

LOG = "log"
CUT = "cut.json"
PROC = "proc.json"
PROGRESS = "progress.jsonl"
ERROR = "error.json"
DONE = "done.json"
EXIT = "exit.json"
SPLIT = "split.json"
CHILDREN = "children.json"  # the selftest stage's record of the processes it started (tests)
# A remote rank's processes as its monitor sees them on its node (state, CPU, title), for the
# watchdog the daemon cannot run there (workers/runtime/tree.py; daemon/phases.py reads it).
TREE = "tree.json"
NATIVE = "native.json"  # and, asked by SIGUSR1, their native stacks (py-spy), taken on the node
KINDS = (LOG, CUT, PROC, PROGRESS, ERROR, DONE, EXIT, SPLIT, CHILDREN, TREE, NATIVE)

# What a rank's long silent phases are (workers/runtime/progress.py `beating(kind=...)`), the
# keys of `[stages.<name>] phase_budgets`: "load" a target's weights in the rank's process,
# "engine_start" a vLLM engine (weights, profiling, compilation), "build" a model from parts,
# "checkpoint" a save, "data" a pass over the dataset, "wait" for a peer or a streaming sibling.
PHASE_KINDS = ("load", "engine_start", "build", "checkpoint", "data", "wait", "other")

SUMMARY = "summary.json"
# A stop the daemon signalled before the store could record it (daemon/intent.py): the reason
# and time, read back by a restarted daemon like attempts.cancel_reason, removed once recorded.
STOP_INTENT = "stop.json"
DRIVER_LOG = "driver.log"  # a vLLM driver's own lines, split from its TP workers' (daemon/logsplit.py)
PROGRESS_GLOB = f"*.{PROGRESS}"
TP_PROC_GLOB = f"tp-*.{PROC}"
TP_LOG_GLOB = f"tp-*.{LOG}"

_TP_PROC = re.compile(rf"tp-(\d+)\.{re.escape(PROC)}")
_RANK_LOG = re.compile(rf"rank-(\d+)\.{re.escape(LOG)}")


def rank_file(rank: int, kind: str) -> str:
    """`rank_file(0, ERROR)` -> "rank-0.error.json"."""
    if kind not in KINDS:
        raise ValueError(f"{kind!r} is not a rank file (one of {', '.join(KINDS)})")
    return f"rank-{rank}.{kind}"


def tp_file(tp_rank: int, kind: str) -> str:
    """`tp_file(1, LOG)` -> "tp-1.log": a file of TP worker `tp_rank` of the attempt's vLLM driver."""
    if kind not in (LOG, PROC, PROGRESS, ERROR):
        raise ValueError(f"{kind!r} is not a TP worker file")
    return f"tp-{tp_rank}.{kind}"


def tp_dir_name(driver_rank: int | None) -> str | None:
    """The folder, inside the attempt directory, of a vLLM driver's TP worker files: none (the
    attempt directory itself) for driver rank 0, whose workers the daemon watches there, and
    "driver-<r>" for each other driver of a data-parallel extraction, so that engines never
    share a file name."""
    return None if not driver_rank else f"driver-{driver_rank}"


def rank_of_log(name: str) -> int | None:
    """The rank a log file belongs to ("rank-3.log" -> 3), else None."""
    m = _RANK_LOG.fullmatch(name)
    return int(m.group(1)) if m else None


def tp_rank_of(name: str) -> int | None:
    """The TP rank a registration file names ("tp-3.proc.json" -> 3), else None."""
    m = _TP_PROC.fullmatch(name)
    return int(m.group(1)) if m else None


# -- the error record ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ErrorRecord:
    """One failure as eyas records it (a row of the errors table): every producer in the
    daemon builds this (a rank's own error file read back, a death by signal or exit code, a
    lost rank, the hang watchdog's Stalled and Straggler, a spawn that failed), and the
    settlement writes it; the root cause is the first of an attempt's records."""

    type: str  # the exception's qualified name, "SIGKILL", "ExitCode", "Stalled", ...
    message: str  # may be empty: the type and traceback then say enough
    traceback: str  # the exception's, else the log's tail or the stacks collected
    time: float  # when it happened (the error file's time, else the exit's)
    source: str  # exception, signal, exit, lost, stall, straggler, disk_full, spawn
    rank: int | None = None
    pid: int | None = None
    host: str | None = None
    path: str | None = None  # the file that says more: the error file, else the rank's log
    role: str | None = None  # "tp-worker" for a vLLM TP worker, else None
    tp_rank: int | None = None
    # The stage's own word that a rerun fails the same way (its error file's "final": evaluate's
    # quality gate): the settlement restarts no attempt for it, whatever max_restarts says.
    final: bool = False

    def replace(self, **changes) -> ErrorRecord:
        return dataclasses.replace(self, **changes)

    def fields(self) -> dict:
        """The keyword arguments of state.store.record_error."""
        out = dataclasses.asdict(self)
        out["time_"] = out.pop("time")
        del out["final"]  # decides the restart only; not a column
        return out


# A line of the demo assets' build progress on its stderr (workers/models/assets.py), which
# `eyas demo` shows while the build runs in its child process.
ASSET_PROGRESS = "eyas-asset-progress: "
