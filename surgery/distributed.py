"""Small distributed helpers: count collectives, and run a function on N local CPU ranks (gloo)."""

from __future__ import annotations

import os
import pickle
import tempfile
from collections import Counter
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives dispatched inside it (`c10d` and functional ops) and the bytes they carry.

    Works where `CommDebugMode` does not (it crashes on FLUX.2 in torch 2.13). `counts` maps op name to calls.
    """

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.bytes = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace in _COLLECTIVE_NAMESPACES and not name.startswith("_") and name != "wait_tensor":
            self.counts[name] += 1
            first = args[0] if args else None
            tensors = first if isinstance(first, (list, tuple)) else [first]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        return func(*args, **(kwargs or {}))


def _entry(rank: int, fn: Callable, world_size: int, store: str, args: tuple, queue, threads: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    # A file store: the ranks meet through a file the parent created, so there is no port to pick (and race for).
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    try:
        # plain pickle: tensors travel as bytes, not as shared memory that would vanish with this process
        queue.put((rank, pickle.dumps(fn(rank, world_size, *args))))
    finally:
        dist.destroy_process_group()


def run_on_cpu_ranks(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned CPU processes joined by gloo; results by rank.

    `fn` must be importable (a module-level function) and return something picklable.
    """
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="surgery-ranks-") as tmp:
        processes = mp.start_processes(
            _entry,
            args=(fn, world_size, os.path.join(tmp, "store"), args, queue, threads),
            nprocs=world_size,
            start_method="spawn",
            join=False,
        )
        results: dict[int, Any] = {}
        finished = False
        while not finished:
            finished = processes.join(timeout=0.05)  # re-raises a rank's exception with its traceback
            while not queue.empty():  # drain as we go, so a large result never blocks its sender
                rank, result = queue.get()
                results[rank] = pickle.loads(result)
    missing = sorted(set(range(world_size)) - results.keys())
    if missing:
        raise RuntimeError(f"ranks {missing} exited without a result")
    return [results[rank] for rank in range(world_size)]
