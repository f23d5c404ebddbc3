"""What the rank-job tests run: a job in which rank 1 waits in a collective that rank 0 never joins, one that ends,
and one whose ranks write their pids and sleep (for a parent killed mid-job)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

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


def sleeper(rank: int, world: int, folder: str) -> None:
    """Each rank writes its pid, then sleeps deaf to SIGINT: torch's own parent-death signal, which a rank busy in C++
    (a long kernel, gloo's teardown) does not act on either; such ranks outlived a killed test run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def parent(folder: str) -> None:
    """A process that starts a 2-rank `sleeper` job (then is killed by the test)."""
    from surgery.testing import run_on_cpu_ranks

    run_on_cpu_ranks(sleeper, 2, folder, timeout=600)


if __name__ == "__main__":
    import sys

    parent(sys.argv[1])
