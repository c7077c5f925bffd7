"""The rank runtime: `python -m eyas.workers.runtime.rank`, run by the rank monitor in every rank.

It reads the rank contract's environment into a RankContext, runs the stage's entry point
with it, and records an uncaught exception in rank-<r>.error.json (like torchelastic's error
file) before the traceback reaches the log. A native crash cannot be recorded that way, so
faulthandler writes its stack into the log instead, and the monitor names the signal.
When the entry point has returned or its error is recorded, the runtime writes
rank-<r>.done.json and ends the process at once (`exit_rank`): a finished rank never waits on
destructors or leftover threads. Light on purpose: stages import torch themselves.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib
import json
import logging
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.state import contract, privacy
from eyas.workers.runtime import atomic, fulldisk
from eyas.workers.runtime.progress import ProgressWriter

log = logging.getLogger("eyas.runtime")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ContractError(Exception):
    """The environment does not hold what the rank contract promises."""


@dataclass
class RankContext:
    """Everything a stage learns from the daemon, read from the rank contract's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    run_id: int | None
    stage: str
    attempt: int
    attempt_dir: Path
    output_dir: Path | None
    config: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    progress: ProgressWriter | None = None

    @property
    def stage_dir(self) -> Path:
        """<output_dir>/<stage>: where the stage's results go, shared by all attempts."""
        if self.output_dir is None:
            raise ContractError(f"{contract.OUTPUT_DIR} is not set: set it to the run's output directory")
        path = self.output_dir / self.stage
        path.mkdir(parents=True, exist_ok=True)
        return path

    def file(self, kind: str) -> Path:
        """This rank's file of the attempt, e.g. file(contract.ERROR) -> rank-0.error.json."""
        return self.attempt_dir / contract.rank_file(self.rank, kind)


def _int_env(env: dict[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ContractError(f"{name} is not set: the daemon sets it for every rank")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ContractError(f"{name}={raw!r} is not an integer: set it to a whole number") from None


def context_from_env(env: dict[str, str] | None = None) -> RankContext:
    """Build the RankContext of this rank from the environment (the rank contract)."""
    env = dict(os.environ if env is None else env)
    stage = env.get(contract.STAGE)
    if not stage:
        raise ContractError(f"{contract.STAGE} is not set: set it to the name of the stage to run")
    if not env.get(contract.ATTEMPT_DIR):
        raise ContractError(f"{contract.ATTEMPT_DIR} is not set: set it to the attempt's directory")
    rank = _int_env(env, contract.RANK, 0)
    run_id = env.get(contract.RUN_ID)
    ctx = RankContext(
        rank=rank,
        world_size=_int_env(env, contract.WORLD_SIZE, 1),
        local_rank=_int_env(env, contract.LOCAL_RANK, rank),
        master_addr=env.get(contract.MASTER_ADDR) or "127.0.0.1",
        master_port=_int_env(env, contract.MASTER_PORT, 29500),  # torch.distributed's default
        run_id=_int_env(env, contract.RUN_ID) if run_id else None,
        stage=stage,
        attempt=_int_env(env, contract.ATTEMPT, 1),
        attempt_dir=Path(env[contract.ATTEMPT_DIR]),
        output_dir=Path(env[contract.OUTPUT_DIR]) if env.get(contract.OUTPUT_DIR) else None,
    )
    ctx.progress = ProgressWriter(ctx.file(contract.PROGRESS))
    config_path = env.get(contract.CONFIG)
    if config_path:
        try:
            ctx.config = json.loads(Path(config_path).read_text())
        except (OSError, ValueError) as exc:
            raise ContractError(f"{contract.CONFIG}={config_path}: cannot read it as JSON ({exc})") from exc
        if not isinstance(ctx.config, dict):
            raise ContractError(f"{contract.CONFIG}={config_path}: holds no JSON object")
        stage_cfg = (ctx.config.get("stages") or {}).get(stage) or {}
        ctx.options = dict(stage_cfg.get("options") or {})
    return ctx


def resolve_entry(stage: str):
    """Import and return the entry function of `stage` (specs.STAGES[stage].entry)."""
    from eyas.state.specs import STAGES

    spec = STAGES.get(stage)
    if spec is None:
        raise LookupError(f"unknown stage {stage!r}: use one of {', '.join(STAGES)}")
    module_name, _, func_name = spec.entry.partition(":")
    return getattr(importlib.import_module(module_name), func_name)


def type_name(exc: BaseException) -> str:
    """Qualified class name, module-prefixed unless builtin: RuntimeError, torch.OutOfMemoryError."""
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def error_record(exc: BaseException, *, rank: int | None, stage: str | None, attempt: int | None) -> dict[str, Any]:
    """The rank-<r>.error.json record of an uncaught exception."""
    if isinstance(exc, SystemExit):
        code = exc.code
        message = f"exit code {code}" if isinstance(code, int) else str(code)
    else:
        message = str(exc)
    now = time.time()
    # An exception that carries the failure it stands for (a vLLM TP worker's, read back from
    # its error file by the driver: workers/vllm/tpfailure.py) is recorded as that failure.
    own = getattr(exc, "eyas_record", None) or {}
    record = {
        "type": own.get("type") or type_name(exc),
        "message": own.get("message", message),
        "traceback": own.get("traceback") or "".join(traceback.format_exception(exc)),  # chained causes included
        "rank": rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "time": now,
        "timestamp": datetime.datetime.fromtimestamp(now).astimezone().isoformat(),
        "stage": stage,
        "attempt": attempt,
    }
    full = own.get("disk_full") if own else fulldisk.disk_full(exc)
    if full is not None:  # the file it could not write, for the root cause (daemon/failures.py)
        record["disk_full"] = full
    if getattr(exc, "eyas_final", False):  # a rerun would fail the same way: never restarted (daemon/settle.py)
        record["final"] = True
    return record


def write_error(path: Path, record: dict[str, Any], reserve: fulldisk.Reserve | None = None) -> None:
    """Write the error file, through `reserve`'s blocks when the rank holds them (a full disk
    then still gets the whole record, its traceback cut to the reserve's size only if it must);
    if even that fails, say so in the log instead of crashing."""
    reserve = reserve or fulldisk.Reserve(path)  # held by nobody: an ordinary atomic write
    try:
        data = _error_json(record)
        try:
            reserve.write(data)
        except OSError as exc:
            if fulldisk.disk_full(exc) is None or len(data) <= reserve.size:
                raise
            reserve.write(_error_json(record, reserve.size))
    except BaseException as exc:  # noqa: BLE001 - reporting must never raise
        say(f"eyas: could not write {path}: {exc!r}; the error was {record['type']}: {record['message']}")


def _error_json(record: dict[str, Any], limit: int | None = None) -> bytes:
    """The error file's bytes (as atomic.write_json writes them); with `limit`, at most that
    many, the traceback's head cut first: its end holds the exception and the frame that raised."""
    data = (json.dumps(record, indent=1) + "\n").encode("utf-8")
    tb = record.get("traceback") or ""
    keep = len(tb)
    while limit is not None and len(data) > limit and keep > 0:
        keep = max(0, keep - (len(data) - limit) - 128)  # 128: the note that says so
        cut = f"[the first {len(tb) - keep} characters of this traceback were cut to fit the disk's last space]\n"
        data = (json.dumps({**record, "traceback": cut + tb[len(tb) - keep :]}, indent=1) + "\n").encode("utf-8")
    return data


def say(text: str) -> None:
    """One line to the log (stderr) that never raises: on a full disk it is lost, not fatal."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else 1
    return 1


def main(env: dict[str, str] | None = None) -> int:
    environ = dict(os.environ if env is None else env)
    reserve = None
    if environ.get(contract.ATTEMPT_DIR):
        # Before the stage can fill the disk: a failed write to the log names it, and the error
        # file's blocks are taken now, so its record lands even then (fulldisk.py says why).
        fulldisk.name_log_streams(rank_file(environ, contract.LOG))
        reserve = fulldisk.Reserve(rank_file(environ, contract.ERROR))
        reserve.hold()
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format=LOG_FORMAT)
    rank = int_or_none(environ.get(contract.RANK))
    # While the stage runs, what it writes is owner-only, but for a run whose output_dir the
    # user chose: the stage runs with the user's umask then, so a team can read the draft; the
    # attempt's records stay 0600 and what else the stage adds to its folder is behind that
    # folder's 0700 (state/privacy.py).
    umask = privacy.rank_umask(environ)
    os.umask(umask)
    ctx: RankContext | None = None
    try:
        ctx = context_from_env(environ)
        if umask != privacy.OWNER_ONLY:
            owner_only(ctx.file(contract.PROGRESS))
        entry = resolve_entry(ctx.stage)
        log.info("rank %d/%d: stage %s, attempt %d", ctx.rank, ctx.world_size, ctx.stage, ctx.attempt)
        entry(ctx)
        return 0
    except BaseException as exc:  # noqa: BLE001 - the point is to record everything
        os.umask(privacy.OWNER_ONLY)  # the stage is over: its error record is a traceback
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            return 0
        attempt_dir = environ.get(contract.ATTEMPT_DIR)
        if ctx is not None:  # its defaults (attempt 1...) say what really ran
            record = error_record(exc, rank=ctx.rank, stage=ctx.stage, attempt=ctx.attempt)
        else:
            record = error_record(
                exc, rank=rank, stage=environ.get(contract.STAGE), attempt=int_or_none(environ.get(contract.ATTEMPT))
            )
        if attempt_dir:
            write_error(rank_file(environ, contract.ERROR), record, reserve)
        # Only after the file exists: whoever reads the log's traceback finds the record too.
        say(record["traceback"].rstrip("\n"))
        return _exit_code(exc)
    finally:
        if ctx is not None and ctx.progress is not None:
            try:
                ctx.progress.close()  # the final update always lands
            except OSError as exc:
                say(f"eyas: could not write progress: {exc}")


def owner_only(path: Path) -> None:
    """Create `path` empty and 0600 where nothing is: a file that exists keeps its mode when
    opened again, so the progress the stage appends to it stays owner-only under any umask."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600))


def rank_file(environ, kind: str) -> Path:
    """This rank's file of the attempt (state/contract.py), named from the raw RANK as the
    monitor names its files (a RankContext may not exist when this is needed)."""
    return Path(environ[contract.ATTEMPT_DIR]) / contract.rank_file(int_or_none(environ.get(contract.RANK)) or 0, kind)


def int_or_none(raw: str | None) -> int | None:
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def exit_rank(code: int) -> None:
    """Record that the stage is over in rank-<r>.done.json, then end the process with `code`.

    The end is os._exit, without interpreter finalisation: what runs there (destructors of
    torch's process groups, atexit hooks, the join of every non-daemon thread) has nothing
    left to save once main() returned, and can hang for ever: a gloo group's destructor waits
    under the GIL for a gloo thread that needs the GIL, a library's thread never ends, an atexit
    hook waits for a dead peer. A finished rank must end. main() has closed the progress file
    and the stages close or join what they write (the hidden-states writer, checkpoints,
    atomic files); what is still buffered in sys.stdout, sys.stderr or a logging handler is
    flushed here. EYAS_RANK_FINALIZE=1 keeps the normal interpreter exit, to debug such a
    destructor; the daemon's straggler rule (stages.<name>.exit_timeout) still bounds it.
    """
    environ = os.environ
    os.umask(privacy.OWNER_ONLY)  # whatever the stage ran with: the done record is the attempt's
    if environ.get(contract.ATTEMPT_DIR):
        # The error file's blocks, if the stage ended without needing them: given back first,
        # so that on a full disk the done record has them.
        fulldisk.Reserve(rank_file(environ, contract.ERROR)).release()
        path = rank_file(environ, contract.DONE)
        try:
            atomic.write_json(path, {"pid": os.getpid(), "time": time.time(), "exit_code": code})
        except OSError as exc:
            say(f"eyas: could not write {path}: {exc}")
    finalize = environ.get(contract.RANK_FINALIZE) == "1"
    log.info(
        "rank done: exit code %d%s", code, "; finalising the interpreter (EYAS_RANK_FINALIZE=1)" if finalize else ""
    )
    logging.shutdown()  # flushes every handler (the stages log through the root logger's)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to save there
            pass
    if finalize:
        sys.exit(code)
    os._exit(code)


if __name__ == "__main__":
    exit_rank(main())
