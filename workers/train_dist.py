"""The rank group's torch.distributed.

gloo on CPU, nccl on CUDA, set up from the rank contract (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE). At world size 1 there is no process group at all: a single rank trains the bare
model with nothing around it. Tensor collectives only (the *_object ones pickle).
"""

from __future__ import annotations

from datetime import timedelta

import torch


class Dist:
    """torch.distributed for the group (gloo on CPU, nccl on CUDA); nothing at world size 1."""

    def __init__(self, ctx, device: str):
        self.world_size = ctx.world_size
        self.rank = ctx.rank
        self.active = False
        if self.world_size > 1:
            import torch.distributed as dist

            dist.init_process_group(
                "nccl" if device == "cuda" else "gloo",
                init_method=f"tcp://{ctx.master_addr}:{ctx.master_port}", rank=ctx.rank,
                world_size=ctx.world_size,
                # A dead peer is the daemon's to notice (it tears the whole group down), not a
                # timeout's: validation and checkpoints may keep one rank waiting for long.
                timeout=timedelta(hours=2),
                **({"device_id": torch.device("cuda", torch.cuda.current_device())} if device == "cuda" else {}))
            self.active = True

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.active:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.active = False
