"""The daemon process itself: `python -m eyas.daemon.main --home DIR` (what
`eyas daemon start` runs, detached, and `--foreground` runs in place), one per state directory.

It holds an flock on `<home>/daemon.lock` for its whole life, keeps its socket reachable
(rebinding it within a second or two when the runtime directory is removed under it) and
keeps `<home>/daemon.json` naming the socket it serves, for clients that compute another one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import logging.handlers
import os
import signal
import sys
import time
from pathlib import Path

import psutil

from eyas.state import paths, privacy, store

from .core import Core
from .logtail import LogTail
from .sampler import Sampler
from .server import Server

log = logging.getLogger("eyas.daemon")

LOG_BYTES = 10 << 20
LOG_BACKUPS = 5
# How often the daemon checks that its socket path still reaches it (one lstat).
SOCKET_CHECK_S = 1.0


class AlreadyRunning(RuntimeError):
    pass


def acquire_lock(home: Path) -> int:
    """One daemon per state directory: an exclusive flock the kernel drops when we die.

    The lock file lives in the state directory (not next to the socket), so a runtime
    directory removed under a live daemon cannot let a second one onto the same database.
    """
    path = paths.lock_path(home)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = paths.lock_holder(home) or "?"
        os.close(fd)
        raise AlreadyRunning(f"an eyas daemon (pid {holder}) already runs for {home}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def setup_logging(home: Path, to_stderr: bool) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    path = home / "daemon.log"
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=LOG_BYTES, backupCount=LOG_BACKUPS)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler.setFormatter(fmt)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    if to_stderr:
        err = logging.StreamHandler(sys.stderr)
        err.setFormatter(fmt)
        root.addHandler(err)
    root.setLevel(logging.INFO)
    return path


async def serve(home: Path, grace: float) -> None:
    db = store.open_writer(paths.db_path(home))
    server: Server | None = None
    core = Core(db, home, grace=grace, sampler=Sampler(log=logging.getLogger("eyas.daemon.sampler")))
    server = Server(paths.socket_path(home), core, log=logging.getLogger("eyas.daemon.server"))
    core.publish = server.publish

    def wants(topic: str) -> bool:
        return any(topic in s.topics for c in server.connections for s in c.subscriptions.values())

    core.wants = wants
    tail = LogTail(core.groups, server.publish, wants)
    await server.start()
    me = {"pid": os.getpid(), "create_time": psutil.Process().create_time(), "started": time.time()}

    def serving() -> None:
        core.served_socket = server.path
        paths.write_record(home, **me, socket=str(server.path))

    serving()  # a daemon that cannot write its state directory does not start
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(
            sig,
            lambda s=sig: (
                log.info("received %s: stopping", signal.Signals(s).name),
                core._spawn_task(core.shutdown()),
            ),
        )

    async def pump_logs():
        while True:
            try:
                tail.tick()
            except Exception:
                log.exception("log tail failed")
            await asyncio.sleep(0.2)

    async def keep_reachable():
        failed = None  # the last error, logged once rather than every second
        while True:
            await asyncio.sleep(SOCKET_CHECK_S)
            why = server.lost()
            if why is None:
                continue
            old = server.path
            try:
                # Computed afresh: the private dirs are made again, under /tmp when the XDG
                # runtime root itself is gone (paths._runtime_root says why).
                await server.rebind(paths.socket_path(home))
            except Exception as exc:  # noqa: BLE001 - this task must outlive any one failure
                if str(exc) != failed:
                    log.error(
                        "socket %s %s, and binding it again failed: %s; retrying every %.0f s",
                        old,
                        why,
                        exc,
                        SOCKET_CHECK_S,
                    )
                failed = str(exc)
                continue
            failed = None
            log.warning("socket %s %s; serving again on %s", old, why, server.path)
            try:
                serving()
            except OSError:
                log.exception(
                    "could not record the new socket in %s; clients that compute "
                    "another path will not find this daemon",
                    paths.record_path(home),
                )

    pump = loop.create_task(pump_logs())
    watch = loop.create_task(keep_reachable())
    log.info("eyas daemon %s serving %s (database %s)", os.getpid(), server.path, paths.db_path(home))
    try:
        await core.run()
    finally:
        pump.cancel()
        watch.cancel()
        await server.close()
        paths.record_path(home).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # our private dir, when nothing else is left in it
            server.path.parent.rmdir()
        # What is queued is written first; a store still locked by another process after
        # that long loses only what the next daemon rebuilds from the attempts' files.
        if core.store.close(timeout=10.0):
            db.conn.close()
        else:
            log.warning("the store thread was still waiting for eyas.db after 10 s: %s", core.store.status())
        log.info("eyas daemon %s stopped", os.getpid())


def state_files(home: Path) -> list[Path]:
    """The state directory and what eyas names in it, the run folders' parent included: what
    the daemon makes owner-only at start-up in a state directory an older eyas made with the
    user's umask. Not recursive: an old run folder is out of reach behind runs/ once that is
    0700, and walking every file of every run (hidden states by the thousand) would slow each start."""
    db = paths.db_path(home)
    names = [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm"), paths.lock_path(home)]
    names += [paths.record_path(home), home / "daemon.out", paths.runs_dir(home), home / "daemon.log"]
    names += [home / f"daemon.log.{n}" for n in range(1, LOG_BACKUPS + 1)]
    return [Path(os.path.realpath(home)), *names]


def run(home: Path, grace: float, to_stderr: bool) -> int:
    # Before anything is made: the state is owner-only, and so is whatever the ranks this daemon
    # starts write, but for the outputs of a run whose output_dir the user chose (state/privacy.py).
    privacy.go_private()
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        lock = acquire_lock(home)
    except AlreadyRunning as exc:
        print(f"eyas daemon: {exc}", file=sys.stderr)
        return 1
    setup_logging(home, to_stderr)
    for line in privacy.tighten(state_files(home)):
        log.warning("made owner-only (it holds prompts, data paths and tracebacks): %s", line)
    try:
        asyncio.run(serve(home, grace))
    except (store.DatabaseDamaged, paths.UnsafeRuntimeDir) as exc:
        # One line with the file and the fix, not a traceback: nothing here can repair it.
        # daemon.log gets it too, except in the foreground, where the log also goes to
        # stderr and would print it twice.
        if not to_stderr:
            log.error("%s", exc)
        print(f"eyas daemon: {exc}", file=sys.stderr)
        return 1
    finally:
        os.close(lock)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eyas-daemon")
    p.add_argument("--home", required=True)
    p.add_argument("--grace", type=float, default=10.0)
    p.add_argument("--stderr", action="store_true", help="also log to stderr")
    a = p.parse_args(argv)
    return run(Path(a.home), a.grace, a.stderr)


if __name__ == "__main__":
    sys.exit(main())
