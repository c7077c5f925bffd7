"""The rank group's torch.distributed: set up from the rank contract, torn down in an order that cannot deadlock.

gloo on CPU, nccl on CUDA (or gloo when asked, as extract does for its totals), set up from
MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE. At world size 1 there is no process group at
all: a single rank works with nothing around it. Tensor collectives only (the *_object ones
pickle). Every stage that uses torch.distributed goes through this one wrapper, because the
teardown order in `Dist.close` is what keeps a finished rank from hanging (see there).
"""

from __future__ import annotations

import gc
import logging
import os
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

log = logging.getLogger("eyas.dist")

# The name gloo gives its worker threads (ProcessGroupGloo::runLoop); they end when the group is destroyed.
GLOO_THREAD = "pt_gloo_runloop"


class Dist:
    """torch.distributed for the group; nothing at world size 1.

    `timeout` bounds a collective that waits for a peer. A dead peer is the daemon's to notice
    (it tears the whole group down), not a timeout's: validation, checkpoints and uneven
    shares of work may keep one rank waiting for long, hence the long defaults.
    """

    def __init__(
        self, ctx, device: str = "cpu", *, backend: str | None = None, timeout: timedelta = timedelta(hours=2)
    ):
        self.active = False
        self._models: list[weakref.ref] = []
        if ctx.world_size > 1:
            import torch.distributed as dist

            # Imported before the group exists: its functions take `group=group.WORLD` as a default,
            # evaluated at import, and DDP imports it lazily (through torch.distributed._shard) once
            # the group exists. That default would then own the group for the life of the process,
            # and its destructor would run in interpreter finalisation, with the GIL held.
            import torch.distributed.nn  # noqa: F401

            backend = backend or ("nccl" if device == "cuda" else "gloo")
            dist.init_process_group(
                backend,
                init_method=f"tcp://{ctx.master_addr}:{ctx.master_port}",
                rank=ctx.rank,
                world_size=ctx.world_size,
                timeout=timeout,
                **({"device_id": torch.device("cuda", torch.cuda.current_device())} if backend == "nccl" else {}),
            )
            self.active = True

    def track(self, model: Any) -> Any:
        """Note a model wrapped on the group (DDP, FSDP); close() checks it is gone before the group goes."""
        self._models.append(weakref.ref(model))
        return model

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.active:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def close(self, release: Callable[[], None] | None = None, *, barrier: bool = True) -> None:
        """Tear the group down; `release` drops the caller's references to the wrapped model.

        Pass barrier=False on a failure path: a peer may be anywhere, and a barrier that pairs
        with some other collective would hang or fail instead of letting the error through.

        Why this order. A gloo worker thread frees each finished collective itself, under the
        group's work mutex; freeing a tensor that Python also sees needs the GIL (torch drops the
        PyObject's reference when the C++ count falls to one). The group's C++ destructor takes
        that same mutex and joins those threads. Run with the GIL held, the two wait for each
        other for ever (pytorch issue 56297). It runs with the GIL held when the last owner of
        the group is C++: the DDP Reducer (or an FSDP state) freed after destroy_process_group,
        as the old teardown had it. So:
        1. barrier: every collective of every rank has completed, none is started after it;
           waiting in it releases the GIL, so the workers finish freeing earlier work meanwhile;
        2. the wrapped model is released and collected while Python still holds the group, so
           the Reducer's reference is never the last one;
        3. destroy_process_group() unregisters the group everywhere;
        4. the last reference, ours, is dropped from Python: torch's binding of ProcessGroup
           (IntrusivePtrNoGilDestructor) releases the GIL before it runs the C++ destructor, so
           a worker that still needs the GIL gets it, and the join ends.
        """
        if not self.active:
            if release is not None:
                release()
            return
        import torch.distributed as dist

        try:
            if barrier:
                dist.barrier()
        finally:
            if release is not None:
                release()
            gc.collect()  # DDP and FSDP modules sit in reference cycles: freed only by a collection
            alive = sum(1 for ref in self._models if ref() is not None)
            if alive:
                log.warning(
                    "%d wrapped model(s) still referenced at teardown: the process group may be "
                    "freed later with the GIL held, which can deadlock",
                    alive,
                )
            group = dist.group.WORLD  # step 4's reference, held across step 3
            dist.destroy_process_group()
            self.active = False
            del group  # the GIL is released while the group's destructor runs


def gloo_threads() -> int:
    """How many gloo worker threads this process has (0 once every gloo group is destroyed)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == GLOO_THREAD
        except OSError:
            pass  # the thread ended while we looked
    return count
