"""Each CPU rank's share of the host's cores, as torchrun gives it (OMP_NUM_THREADS=1 there)."""

from __future__ import annotations

import logging
import os
import sys

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


def passive_waits() -> bool:
    """Have OpenMP's idle threads sleep at once instead of spinning (OMP_WAIT_POLICY=PASSIVE),
    unless the environment sets a policy; True when it was set here. Call it before torch loads:
    libgomp reads the policy once, when torch's libraries load.

    With the default (spinning) policy, a rank with more than one thread whose cores other
    processes also use waits at every parallel region's barrier for a thread the kernel has put
    aside: the hf extraction of 60 chats on the tiny DeepSeek, one rank of 2 threads on a shared
    2-core host, ran at 154-1389 tok/s against 6,400-6,800 with one thread, and 4,500-6,500 with
    2 threads and this policy. Its cost, a wake-up of microseconds per parallel region, was not
    measured on a large target.
    """
    if "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True
