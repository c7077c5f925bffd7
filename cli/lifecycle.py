"""`eyas daemon start|stop|status`: start at most one daemon per state directory, stop it, report it.

Every client here finds the daemon through paths.find_socket (the client's default path), so
a daemon serving from another runtime directory than this shell computes is still found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil

from eyas.state import paths, procs
from eyas.wire.client import Client, DaemonError, DaemonNotRunning


def command(args) -> int:
    return {"start": start, "stop": stop, "status": status}[args.action](args)


def _ping(timeout: float = 2.0, op: str = "ping") -> dict | None:
    try:
        with Client(timeout=timeout) as c:
            return c.request(op)
    except (DaemonNotRunning, DaemonError, OSError, TimeoutError):
        return None


def _another_holds_the_lock(home, mine: int) -> bool:
    """Our daemon process ended: was it refused because another one, still starting, holds the lock?"""
    holder = paths.lock_holder(home)
    return holder is not None and holder != mine and procs.alive(holder, None)


def start(args) -> int:
    home = paths.state_dir()
    if args.foreground:
        from eyas.daemon import main as daemon_main

        return daemon_main.run(home, args.grace, to_stderr=True)
    running = _ping()
    if running:
        return _already(running, home)
    # Owner-only, as the daemon keeps its state (state/privacy.py); this process keeps the
    # user's umask, which the daemon inherits and hands on to the outputs of their own output_dir.
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Detach: a new session, no terminal, nothing inherited from this shell. Early crashes
    # (before logging is set up) land in daemon.out.
    out_fd = os.open(home / "daemon.out", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with open(out_fd, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "eyas.daemon.main", "--home", str(home), "--grace", str(args.grace)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            close_fds=True,
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = _ping(op="status")
        if info and info["pid"] != proc.pid:
            # Another start won the race for the state directory's lock, so ours is refused:
            # wait for it to go, so that one daemon process is left when we return.
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
            return _already(info, home)
        if info:
            print(
                f"eyas daemon started (pid {info['pid']})\n  socket   {info['socket']}\n"
                f"  database {paths.db_path(home)}\n  log      {home / 'daemon.log'}"
            )
            return 0
        if proc.poll() is not None and not _another_holds_the_lock(home, proc.pid):
            break
        time.sleep(0.1)
    tail = (home / "daemon.out").read_text(errors="replace")[-2000:]
    print(f"eyas daemon did not start (exit {proc.poll()}):\n{tail}", file=sys.stderr)
    return 1


def _already(info: dict, home) -> int:
    # 0: what `start` is for, a daemon serving this state directory, holds.
    print(f"eyas daemon already running (pid {info['pid']}) for {home}")
    return 0


def stop(args) -> int:
    try:
        with Client(timeout=10) as c:
            pid = c.request("ping")["pid"]
            c.request("shutdown", **({"grace": args.grace} if args.grace is not None else {}))
    except DaemonNotRunning:
        print("eyas daemon is not running")
        return 0
    deadline = time.monotonic() + (args.grace if args.grace is not None else 10) + 30
    while time.monotonic() < deadline:
        # A zombie has stopped too: its parent (a supervisor, a test) has yet to reap it.
        try:
            gone = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            gone = True
        if gone:
            print(f"eyas daemon stopped (pid {pid})")
            return 0
        time.sleep(0.05)
    print(f"eyas daemon (pid {pid}) did not stop in time", file=sys.stderr)
    return 1


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def status(args) -> int:
    try:
        with Client(timeout=5) as c:
            info = c.request("status")
    except DaemonNotRunning:
        if args.json:
            print(json.dumps({"running": False, "home": str(paths.state_dir())}))
        else:
            print(f"eyas daemon is not running (state {paths.state_dir()})")
        return 3
    if args.json:
        print(json.dumps({"running": True, **info}, indent=2))
        return 0
    print(f"eyas daemon running (pid {info['pid']}, up {_duration(info['uptime'])})")
    print(f"  socket   {info['socket']}\n  database {info['database']}")
    print(f"  GPUs     {'NVML' if info.get('gpu') else 'none (CPU figures only)'}")
    if info.get("full"):
        # Said first: while it lasts no attempt starts and ends are recorded only once space returns.
        print(
            f"  state directory full: {info['full']['what']} (since {_duration(time.time() - info['full']['since'])}"
            " ago; no attempt starts, records wait for space)"
        )
    if info.get("store_busy"):
        busy = info["store_busy"]
        # The daemon goes on supervising; what it records waits in order for the lock.
        print(
            f"  store busy: another process holds {info['database']} locked (for "
            f"{_duration(time.time() - busy['since'])}; {busy['pending'] + 1} writes waiting, first "
            f"{busy['what']}; no attempt starts until it is released)"
        )
    if not info["active"]:
        print("  no active runs")
    for a in info["active"]:
        rate = f", {a['tok_s']:.0f} tok/s" if a.get("tok_s") else ""
        print(f"  run {a['run_id']}: {a['stage']} attempt {a['attempt']}, {a['world_size']} ranks{rate}")
    for run_id, why in info.get("waiting", {}).items():
        print(f"  run {run_id}: {why}")
    return 0
