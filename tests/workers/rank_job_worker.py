"""What the rank-job tests run: a job in which rank 1 waits in a collective that rank 0 never joins."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def stuck(rank: int, world: int) -> str:
    if rank == 0:
        time.sleep(600)  # never reaches the broadcast: rank 1 waits for it
    else:
        dist.broadcast(torch.zeros(1), src=0)
    return "done"


def fine(rank: int, world: int) -> int:
    dist.all_reduce(tensor := torch.ones(1))
    return int(tensor.item())
