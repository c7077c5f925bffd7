"""The tensor-parallel workers of a vLLM driver rank, as extra ranks of its group: registered from their proc files, watched through pidfds, their log lines split from the driver's, their deaths judged by what vLLM's executor reported.

A vLLM driver rank's engine spawns them (they live in the driver's session and process tree);
eyas's worker extension registers each one at start-up in `tp-<k>.proc.json`. The group picks
these up as extra ranks (role "tp-worker", numbered world_size + k after the driver ranks),
samples them apart from the driver, tears them down with it, and settles their failures:
- an error record `tp-<k>.error.json` (written inside the worker before vLLM flattens the
  exception into a string for the driver) is that TP rank's failure, at its own time, even
  while the process still runs: the group is torn down at once;
- a worker that dies is a failure only if vLLM's executor, its parent, reported it
  "died unexpectedly (exit code: N)" (read from the driver's log by logsplit.py); a worker
  ending while the engine shuts down (vLLM SIGKILLs stragglers itself) is not.
The driver's combined log is split into `tp-<k>.log` and `driver.log` (logsplit.py).
"""

from __future__ import annotations

import asyncio
import os
import time

from eyas.state import contract, procs

from .logsplit import LogSplitter
from .ranks import Rank, RankExit, read_json


class TPWorkers:
    """The TP-worker half of a Group (daemon/group.py), which holds `workers`, `pidfds`, `splitter`, `ranks`, `dir`."""

    def tp_error(self, worker: Rank) -> dict | None:
        """tp-<k>.error.json, when this attempt's TP worker k wrote it."""
        return self.own_record(contract.tp_file(worker.tp_rank, contract.ERROR), {worker.pid})

    def _learn_tp(self) -> list[Rank]:
        """TP workers that registered since the last pass (tp-<k>.proc.json)."""
        new = []
        for path in self.dir.glob(contract.TP_PROC_GLOB):
            k = contract.tp_rank_of(path.name)
            if k is None:
                continue
            known = self.workers.get(k)
            proc = read_json(path)
            if not proc or not proc.get("pid"):
                continue
            if known is not None and known.pid == proc["pid"]:
                continue
            d = proc.get("driver_rank") or 0
            driver = self.ranks[d] if isinstance(d, int) and 0 <= d < len(self.ranks) else None
            worker = Rank(
                self.world_size + k,
                self.dir / contract.tp_file(k, contract.LOG),
                driver.monitor_pid if driver else 0,
                driver.monitor_create_time if driver else None,
                None,
                proc["pid"],
                proc.get("create_time"),
                proc.get("device"),
                role="tp-worker",
                tp_rank=k,
                started_at=proc.get("time"),
            )
            self.workers[k] = worker
            if driver is not None and driver.role is None:
                driver.role = "driver"
            if self.splitter is None and driver is not None:
                self.splitter = LogSplitter(driver.log_path, self.dir / contract.rank_file(driver.rank, contract.SPLIT))
            new.append(worker)
        return new

    def watch(self, worker: Rank) -> None:
        """Note the moment a TP worker ends, through a pidfd in the daemon's event loop.

        The worker is not the daemon's child (vLLM's EngineCore reaps it), so no exit status
        reaches the daemon; but its end time decides the root cause when the driver fails
        moments later because of it, and a 20 Hz poll can be later than the driver's own
        error record. A pidfd wakes the loop as the process ends. Without a running loop or
        pidfd support, the poll's time is used."""
        try:
            loop = asyncio.get_running_loop()
            fd = os.pidfd_open(worker.pid)
        except (RuntimeError, AttributeError, OSError, TypeError):
            return
        if not procs.alive(worker.pid, worker.create_time):  # the pid was reused, or it is gone already
            os.close(fd)
            return

        def ended() -> None:
            if worker.ended_at is None:
                worker.ended_at = time.time()
            self._unwatch(worker.tp_rank)

        self._unwatch(worker.tp_rank)
        self.pidfds[worker.tp_rank] = fd
        loop.add_reader(fd, ended)

    def _unwatch(self, tp_rank: int) -> None:
        fd = self.pidfds.pop(tp_rank, None)
        if fd is not None:
            try:
                asyncio.get_running_loop().remove_reader(fd)
            except RuntimeError:
                pass
            os.close(fd)

    def close(self) -> None:
        """Stop watching the TP workers (the group is settled)."""
        for k in list(self.pidfds):
            self._unwatch(k)

    def tp_of_pid(self, pid: int) -> int | None:
        """The TP rank of a worker pid; a miss rescans the proc files once (a worker writes
        its proc file before its first log line, so a line can never outrun it for good)."""
        for k, w in self.workers.items():
            if w.pid == pid:
                return k
        for path in self.dir.glob(contract.TP_PROC_GLOB):
            proc = read_json(path) or {}
            if proc.get("pid") == pid:
                return proc.get("tp_rank")
        return None

    def _poll_tp(self, final: bool = False) -> list[RankExit]:
        exits = []
        if self.splitter is not None:
            self.splitter.pump(self.tp_of_pid, final=final)
            for k, code in self.splitter.died.items():
                w = self.workers.get(k)
                if w is not None and w.exit is not None and not w.exit.unexpected and w.exit.error is None:
                    self._mark_unexpected(w.exit, code)
                    exits.append(w.exit)
        now = time.time()
        for k, w in sorted(self.workers.items()):
            if w.exit is not None:
                continue
            error = self.tp_error(w)
            if error is not None:
                w.exit = RankExit(
                    w.rank, error.get("pid") or w.pid, None, None, float(error.get("time") or now), error, tp_rank=k
                )
            elif not procs.alive(w.pid, w.create_time):
                w.exit = RankExit(w.rank, w.pid, None, None, w.ended_at or now, tp_rank=k)
                if self.splitter is not None and k in self.splitter.died:
                    self._mark_unexpected(w.exit, self.splitter.died[k])
            else:
                continue
            exits.append(w.exit)
        return exits

    @staticmethod
    def _mark_unexpected(ex: RankExit, code: int | None) -> None:
        """vLLM's exit code is multiprocessing's: negative for a signal; None when vLLM
        looked before the process was reaped."""
        ex.unexpected = True
        if code is not None and code < 0:
            ex.signal, ex.exit_code = -code, None
        elif code is not None:
            ex.exit_code = code

    def settle_workers(self) -> list[RankExit]:
        """The last word on the TP workers once the driver has ended: read the rest of the
        driver's log (vLLM's death reports) and give every worker an exit."""
        if not self.workers:
            return []
        self._learn_tp()
        exits = self._poll_tp(final=True)
        now = time.time()
        for k, w in self.workers.items():
            if w.exit is None:  # still running after teardown: it was killed with the group
                w.exit = RankExit(w.rank, w.pid, None, None, w.ended_at or now, tp_rank=k)
                exits.append(w.exit)
        self.close()
        return exits
