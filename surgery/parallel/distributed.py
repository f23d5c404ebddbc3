"""Small distributed helpers: check a mesh, count collectives, and run a function on N local CPU ranks (gloo)."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import pickle
import signal
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Callable, Iterator, NoReturn

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.testing._internal.distributed.fake_pg import FakeStore
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from surgery.core.errors import SurgeryError

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


_KINDS = {"tp": "tensor-parallel", "cp": "context-parallel"}


def one_dim_mesh(mesh, verb: str, dim: str = "tp") -> DeviceMesh:
    """`mesh` when it is a one-dimensional DeviceMesh; else a SurgeryError naming the sub-mesh to pass (`mesh[dim]`)."""
    kind = _KINDS.get(dim, f"'{dim}'")
    build = f"init_device_mesh(device_type, (..., size), mesh_dim_names=(..., '{dim}'))"
    if not isinstance(mesh, DeviceMesh):
        raise SurgeryError(f"surgery.{verb}: expected a torch DeviceMesh, got {type(mesh).__name__}. Build one with "
                           f"torch.distributed.device_mesh.{build} and pass mesh['{dim}'].")
    if mesh.ndim != 1:
        names = tuple(mesh.mesh_dim_names or ())
        hint = (f"Pass its {kind} sub-mesh, mesh['{dim}']." if dim in names else
                f"It has no dimension named '{dim}' (names: {names or 'none'}); build it with {build} and pass "
                f"mesh['{dim}'].")
        raise SurgeryError(f"surgery.{verb}: the mesh has {mesh.ndim} dimensions {tuple(mesh.shape)}, where "
                           f"{kind} work runs over one. {hint}")
    return mesh


# The aten ops a Linear becomes once dispatched (`linear` decomposes to `mm`/`addmm`, batched inputs to `bmm`), and the
# ops that copy activations (a `cat` writes its inputs anew; `split`s are views, counted to see the cat-then-split).
GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_int_mm"})
COPIES = frozenset({"cat", "stack"})
SPLITS = frozenset({"split", "split_with_sizes", "chunk", "unsafe_split", "unsafe_split_with_sizes"})


class CollectiveCounter(TorchDispatchMode):
    """Counts the work dispatched inside it: collectives (`c10d` and functional ops) and the bytes they carry, GEMMs,
    copies (`cat`) and splits, as each rank runs them: the local ops beneath DTensor's (never the fake ones of its
    shape propagation).

    Works where `CommDebugMode` does not (it crashes on FLUX.2 in torch 2.13). `counts` maps collective name to
    calls; `ops` maps every other counted aten op (`mm`, `addmm`, `cat`, ...) to calls. An op on DTensors is handed back
    to DTensor first (as `CommDebugMode` does), so that the collectives DTensor inserts inside an op (a mean over a
    sharded dim resolved by the next op) are counted too, not only those that the styles' hooks issue.
    """

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self.bytes = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def gemms(self) -> int:
        return sum(n for op, n in self.ops.items() if op in GEMMS)

    @property
    def cats(self) -> int:
        return sum(n for op, n in self.ops.items() if op in COPIES)

    @property
    def splits(self) -> int:
        return sum(n for op, n in self.ops.items() if op in SPLITS)

    def work(self) -> dict[str, int]:
        """GEMMs, cats, splits and all-reduces (every collective) in one row, as the benchmarks print them."""
        return {"gemm": self.gemms, "cat": self.cats, "split": self.splits, "collective": self.total}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        name = func.__name__.split(".")[0]
        if func.namespace in _COLLECTIVE_NAMESPACES and not name.startswith("_") and name != "wait_tensor":
            self.counts[name] += 1
            first = args[0] if args else None
            tensors = first if isinstance(first, (list, tuple)) else [first]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        elif func.namespace == "aten" and (name in GEMMS or name in COPIES or name in SPLITS) and not _on_meta(args):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _on_meta(args: tuple) -> bool:
    """Whether an op runs on meta or fake tensors: DTensor's shape propagation, not work."""
    first = args[0] if args else None
    first = first[0] if isinstance(first, (list, tuple)) and first else first
    return isinstance(first, FakeTensor) or (isinstance(first, torch.Tensor) and first.is_meta)


def _die_with(parent: int) -> None:
    """Have the kernel kill this rank when the process that started it dies (a test run killed mid-job), so that no
    rank lives on holding its memory and CPU. Linux's `prctl(PR_SET_PDEATHSIG)`; elsewhere a rank outlives it.

    A rank forked by the forkserver dies with the server, and the server exits once no process holds the write end
    of its "alive" pipe: `parent` and each forked rank hold one, so the rank closes its copy (Python keeps it in the
    private `_forkserver_alive_fd`, for a rank that would start processes of its own; ours start none). Whoever died
    before the prctl sent no signal, so `parent` must still be alive after it (a zombie is dead)."""
    if not sys.platform.startswith("linux"):
        return
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    try:
        alive = open(f"/proc/{parent}/stat").read().rpartition(") ")[2][0] != "Z"
    except FileNotFoundError:
        alive = False
    if not alive:
        os._exit(1)


class _Stdio:
    """The parent's stdout and stderr as they are when the job starts (pytest's capture of the running test), for the
    rank to write to: a forked rank would otherwise write to the forkserver's, those of whichever test started it."""

    def __init__(self, out=None, err=None):
        self.out, self.err = out, err

    def __reduce__(self):  # runs while the rank is launched: multiprocessing hands both descriptors over
        return _Stdio, (multiprocessing.reduction.DupFd(1), multiprocessing.reduction.DupFd(2))

    def adopt(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.out.detach(), 1)
        os.dup2(self.err.detach(), 2)


def _entry(rank: int, fn: Callable, world_size: int, store: str, args: tuple, queue, threads: int,
           parent: int, environ: dict, stdio: _Stdio | None) -> None:
    _die_with(parent)
    if stdio is not None:  # forked by the server; a spawned rank has the parent's already
        stdio.adopt()
    os.environ.clear()  # the parent's environment now, not the forkserver's from when it started
    os.environ.update(environ)
    torch.set_num_threads(threads)
    # The parent sends SIGUSR1 before it kills a rank that ran past its time: every thread's stack goes to stderr.
    if hasattr(signal, "SIGUSR1"):  # POSIX only
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    # A file store: the ranks meet through a file the parent created, so there is no port to pick (and race for).
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    try:
        # plain pickle: tensors travel as bytes, not as shared memory that would vanish with this process
        queue.put((rank, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_together()  # the result is already written to the parent's pipe


def leave_together() -> NoReturn:
    """End a rank's process (ours, or one torchrun started) once every rank is done with its collectives.

    Tear down together: no rank closes its connections while a peer still runs its last collective. Then leave without
    running torch's C++ destructors at interpreter exit, where gloo's threads race them under load ("terminate called
    without an active exception", SIGABRT after the work was done: seen in our rank jobs and in a torchrun benchmark
    on a loaded CI machine). Whatever the caller wrote must be closed first; stdout and stderr are flushed here."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# What every rank imports before it runs anything (about 7 s of CPU each). A forkserver imports them once per process
# that starts rank jobs, and each rank forks from it. Safe to fork: importing them starts no thread of torch's
# (its OpenMP pool starts at the first parallel op, in the rank); numpy's OpenBLAS starts one, which OpenBLAS stops
# around a fork (pthread_atfork).
_PRELOAD = ["torch", "torch.distributed", "diffusers", "surgery", "surgery_rewrites", "surgery.testing"]


def _start_method() -> str:
    """forkserver with the heavy imports preloaded and the server started; spawn where there is no forkserver."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    multiprocessing.forkserver.set_forkserver_preload(_PRELOAD)  # read when the server starts; later calls no-op
    multiprocessing.forkserver.ensure_running()
    return "forkserver"


def run_on_cpu_ranks(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1,
                     timeout: float | None = None) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` CPU processes joined by gloo; results by rank.

    `fn` must be importable (a module-level function) and return something picklable. A job still running after
    `timeout` seconds (default: `SURGERY_RANKS_TIMEOUT`, else 900) has every rank print its stacks, is killed, and
    raises `TimeoutError`: a rank waiting in a collective for another becomes a failure that says where, not a hang.
    """

    if timeout is None:
        timeout = float(os.environ.get("SURGERY_RANKS_TIMEOUT", 900))
    method = _start_method()
    deadline = time.monotonic() + timeout  # from when the server is up: its imports are not the job's
    queue = mp.get_context(method).SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="surgery-ranks-") as tmp:
        processes = mp.start_processes(
            _entry,
            args=(fn, world_size, os.path.join(tmp, "store"), args, queue, threads, os.getpid(), dict(os.environ),
                  _Stdio() if method == "forkserver" else None),
            nprocs=world_size,
            start_method=method,
            join=False,
        )
        results: dict[int, Any] = {}
        finished = False
        while not finished:
            finished = processes.join(timeout=0.05)  # re-raises a rank's exception with its traceback
            while not queue.empty():  # drain as we go, so a large result never blocks its sender
                rank, result = queue.get()
                results[rank] = pickle.loads(result)
            if not finished and time.monotonic() > deadline:
                _kill(processes.processes)
                raise TimeoutError(
                    f"run_on_cpu_ranks({getattr(fn, '__qualname__', fn)!r}, world {world_size}): still running "
                    f"after {timeout:.0f} s (ranks with a result: {sorted(results)}); each rank's stacks are above."
                )
    missing = sorted(set(range(world_size)) - results.keys())
    if missing:
        raise RuntimeError(f"ranks {missing} exited without a result")
    return [results[rank] for rank in range(world_size)]


def _kill(processes) -> None:
    if hasattr(signal, "SIGUSR1"):
        # one rank at a time, each under its own heading: stacks written at once interleave on the shared stderr
        for rank, process in enumerate(processes):
            if process.is_alive():
                print(f"run_on_cpu_ranks: rank {rank} (pid {process.pid}), its stacks:", file=sys.stderr, flush=True)
                os.kill(process.pid, signal.SIGUSR1)
                time.sleep(1.5)  # time to write them
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()


@contextlib.contextmanager
def fake_process_group(world: int, rank: int = 0) -> Iterator[None]:
    """torch's fake process group (backend "fake"): collectives are no-ops, so a mesh of any size fits one CPU."""

    if dist.is_initialized():
        raise SurgeryError("planning uses torch's fake process group; run it where no process group is initialized.")
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
