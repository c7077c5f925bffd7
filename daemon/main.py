"""The daemon process itself: `python -m eyas.daemon.main --home DIR` (what
`eyas daemon start` runs, detached, and `--foreground` runs in place)."""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import logging
import logging.handlers
import os
import signal
import sys
from pathlib import Path

from eyas.state import paths, store

from .core import Core
from .logtail import LogTail
from .sampler import Sampler
from .server import Server

log = logging.getLogger("eyas.daemon")

LOG_BYTES = 10 << 20
LOG_BACKUPS = 5


class AlreadyRunning(RuntimeError):
    pass


def acquire_lock(home: Path) -> int:
    """One daemon per state directory: an exclusive flock the kernel drops when we die."""
    path = paths.lock_path(home)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
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
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, lambda s=sig: (log.info("received %s: stopping", signal.Signals(s).name),
                                                     core._spawn_task(core.shutdown())))

    async def pump_logs():
        while True:
            try:
                tail.tick()
            except Exception:
                log.exception("log tail failed")
            await asyncio.sleep(0.2)

    pump = loop.create_task(pump_logs())
    log.info("eyas daemon %s serving %s (database %s)", os.getpid(), paths.socket_path(home), paths.db_path(home))
    try:
        await core.run()
    finally:
        pump.cancel()
        await server.close()
        db.conn.close()
        log.info("eyas daemon %s stopped", os.getpid())


def run(home: Path, grace: float, to_stderr: bool) -> int:
    home.mkdir(parents=True, exist_ok=True)
    try:
        lock = acquire_lock(home)
    except AlreadyRunning as exc:
        print(f"eyas daemon: {exc}", file=sys.stderr)
        return 1
    setup_logging(home, to_stderr)
    try:
        asyncio.run(serve(home, grace))
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
