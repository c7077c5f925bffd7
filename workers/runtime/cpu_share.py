"""Each CPU rank's share of the host's cores, as torchrun gives it (OMP_NUM_THREADS=1 there)."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("eyas.cpu")


def share_cpus(world_size: int, others: int = 0) -> int | None:
    """Set torch's thread count to this rank's share of the cores; return it (None: untouched).

    Every rank would otherwise start one thread per core: N ranks then run N times as many
    threads as cores, and their OpenMP barriers make the group several times slower than
    one rank alone. `others`: ranks of another group on this host at the same time (a streaming
    run's other half). An explicit OMP_NUM_THREADS wins.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size) + others
    threads = max(1, len(os.sched_getaffinity(0)) // max(1, local))
    torch.set_num_threads(threads)
    log.info("using %d CPU threads (%d ranks on this host)", threads, local)
    return threads
