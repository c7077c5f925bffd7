"""The daemon's core: the state the daemon process holds (live groups, device queues, the store thread) and its loop; the work is done by the halves it is made of.

Where to look:
- daemon/api.py: the socket API's requests (submit, stop, retry, skip, resume, stacks, status);
- daemon/scheduler.py: which attempt starts next, recorded before its ranks are spawned;
- daemon/agent.py: supervision of the live groups (exits, teardown, the watchdog, stops);
- daemon/settle.py: a group's end recorded whole, and the restart policy;
- daemon/failures.py: how the root cause is chosen;
- daemon/recovery.py: what a starting daemon re-adopts;
- daemon/metrics.py: the 1 Hz samples;
- daemon/recording.py: the way to the store (every read and write runs on the store thread).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from pathlib import Path

from eyas.state import paths, store

from . import diskfull
from .agent import Agent
from .api import Api
from .group import Group
from .metrics import Metrics
from .recording import Recording
from .recovery import Recovery
from .sampler import Sampler
from .scheduler import Scheduler
from .storewriter import Writer

log = logging.getLogger("eyas.daemon.core")

SAMPLE_PERIOD = 1.0
# Retention (docs/supervision.md): raw samples older than a week go, and never more than 2M rows;
# the history listings read roll-ups, which are kept forever.
METRICS_MAX_AGE = 7 * 24 * 3600.0
METRICS_MAX_ROWS = 2_000_000
PRUNE_PERIOD = 600.0


class Core(Api, Scheduler, Agent, Recovery, Metrics, Recording):
    """The daemon: the socket server's handler (`handle`), and the only writer of the store."""

    def __init__(
        self, db, home: Path, *, grace: float = 10.0, sampler: Sampler | None = None, publish=None, wants=None
    ):
        self.db = db  # the store thread's connection: used only inside store jobs
        self.store = Writer(db, on_busy=self._store_changed)
        self.home = home
        self.grace = grace
        self.sampler = sampler or Sampler()
        self.publish = publish or (lambda topic, data: None)
        self.wants = wants or (lambda topic: False)
        self.host = socket.gethostname()
        self.groups: dict[int, Group] = {}  # attempt id -> live group
        # A full state directory (daemon/diskfull.py): no attempt starts while it lasts.
        self.disk = diskfull.Condition(home)
        self.served_socket: Path | None = None  # set by the daemon's main as it binds (and rebinds)
        self.disk.on_change = self._disk_changed
        # The state events of the store job running on this thread: published once it commits.
        self._local = threading.local()
        self._planning = False  # a scheduling pass is recording or spawning
        self._decide = asyncio.Lock()  # held while the scheduler plans and spawns, and by a stop
        self.submitting: str | None = None  # the Slurm submission the scheduler waits on, if any
        self._metrics_lock = threading.Lock()
        self._metrics_buf: dict | None = None  # samples waiting for the store thread
        self.waiting: dict[int, str] = {}  # run id -> why it waits
        self.started = time.time()
        self.stopping = False
        self._dirty = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._last_sample = 0.0
        self._last_prune = 0.0
        self.stage_live: dict[tuple[int, str], dict] = {}  # latest roll-up per running stage

    def poke(self) -> None:
        self._dirty.set()

    def prune(self) -> None:
        now = time.time()
        self.write_later(
            lambda db: store.prune_metrics(db, max_age_s=METRICS_MAX_AGE, max_rows=METRICS_MAX_ROWS, now=now),
            "pruning metrics",
        )

    def _step(self, what: str, fn, *args, **kwargs) -> None:
        """One step of the supervision loop. The daemon survives its own bugs (logged) and a
        full state directory (noted on the condition, retried with backoff); it keeps supervising."""
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            if diskfull.is_full(exc):
                self.disk.mark(what, exc)
            else:
                log.exception("%s pass failed", what)

    async def run(self) -> None:
        """The supervision loop: 20 Hz rank checks, scheduling on change, 1 Hz sampling."""
        self._shutdown_done = asyncio.Event()
        await self.recover()
        try:
            await self.check_run_folders()
        except OSError:
            log.exception("could not look through %s for run folders", paths.runs_dir(self.home))
        while not self._shutdown_done.is_set():
            now = time.time()
            # Each step on its own: one that fails (a bug, a full disk) must not stop the
            # others, the hang watchdog least of all.
            self._step("supervision", self.supervise)
            if self._dirty.is_set() or now - self._last_sample >= SAMPLE_PERIOD:
                self._dirty.clear()
                self._step("scheduling", self.schedule)
            if now - self._last_sample >= SAMPLE_PERIOD:
                self._last_sample = now
                self._step("checking free space", self.disk.check, now)
                if not self.disk.full:  # metrics wait for space; the record comes first
                    self._step("writing metrics to eyas.db", self.sample, now)
                self._step("hang watch", self.watch_hangs, now)
            if now - self._last_prune >= PRUNE_PERIOD and not self.disk.full:
                self._last_prune = now
                self._step("pruning metrics", self.prune)
            try:
                await asyncio.wait_for(self._dirty.wait(), timeout=0.05)
            except TimeoutError:
                pass
