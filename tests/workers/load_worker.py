"""What each gloo rank runs for the sharded-loading tests."""

from __future__ import annotations

import ctypes
import threading
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import surgery
from surgery.sight.report import local as _local, local_bytes
from flux2_testing import build, inputs, rel_err, small_config


def compare(rank: int, world: int, checkpoint: str, name: str, seed: int, dtype_name: str) -> dict:
    """The loaded model vs unfuse + tensor_parallel of the fully built model: placements and bytes; and forward."""
    mesh = init_device_mesh("cpu", (world,))
    dtype = getattr(torch, dtype_name)
    loaded = surgery.load_tensor_parallel(None, checkpoint, mesh, progress=False)
    config = small_config(name)
    fused = build(config, seed, dtype)
    reference = surgery.tensor_parallel(surgery.unfuse(build(config, seed, dtype)), mesh, src_data_rank=None)
    mismatched = [
        n for n, p in reference.named_parameters()
        if type(p) is not type(loaded.get_parameter(n))
        or (isinstance(p, DTensor) and p.placements != loaded.get_parameter(n).placements)
        or p.dtype != loaded.get_parameter(n).dtype
        or not torch.equal(_local(p), _local(loaded.get_parameter(n)))
    ]
    kw = inputs(config, seed, dtype=dtype)
    with torch.no_grad():
        error = rel_err(loaded(**kw).sample, fused(**kw).sample)
    return {"mismatched": mismatched, "forward": error, "params": len(list(loaded.parameters()))}


def compare_all(rank: int, world: int, specs: list[tuple]) -> list[dict]:
    """`compare` for several (checkpoint, config name, seed, dtype) in one job."""
    return [compare(rank, world, *spec) for spec in specs]


class PeakMemory:
    """Samples this process's resident memory in a thread; `peak` is the most above the start.

    `field` is a line of /proc/self/status: "RssAnon" counts memory the process owns; "VmRSS" also counts mapped
    file pages (safetensors maps the checkpoint: pages count once read, in page-cache folios that can be larger
    than a small tensor's rows).
    """

    def __init__(self, field: str = "RssAnon"):
        self.field = field

    def __enter__(self):
        self.start = self.peak_value = self._read()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._running = False
        self._thread.join()
        self.peak_value = max(self.peak_value, self._read())

    @property
    def peak(self) -> int:
        return self.peak_value - self.start

    def _read(self) -> int:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith(f"{self.field}:"))
        return int(line.split()[1]) * 1024

    def _sample(self):
        while self._running:
            self.peak_value = max(self.peak_value, self._read())
            time.sleep(0.001)


def _touch(model) -> None:
    """Read every local parameter: safetensors maps files lazily, so a page counts once it is read."""
    with torch.no_grad():
        for p in model.parameters():
            _local(p).sum()


def peak_memory(rank: int, world: int, checkpoint: str, warmup: str) -> dict:
    """Peak owned memory and time of this rank's sharded load, and of diffusers' full load (rank 0).

    Both load the fp32 checkpoint as bf16, so each process materializes exactly what it keeps (an fp32 -> fp32
    load would keep zero-copy views of the mapped file). Each loader first runs on the small `warmup` checkpoint,
    so lazy imports and one-time allocations are not counted.
    """
    from diffusers import Flux2Transformer2DModel

    # A fixed mmap threshold: every allocation of 64 KiB or more is mapped and returned to the system when freed,
    # so glibc's heap does not keep (and hide) what the warm-up freed.
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    mesh = init_device_mesh("cpu", (world,))
    load = lambda path: surgery.load_tensor_parallel(None, path, mesh, dtype=torch.bfloat16, progress=False)  # noqa: E731
    full = lambda path: Flux2Transformer2DModel.from_pretrained(path, torch_dtype=torch.bfloat16)  # noqa: E731
    _touch(load(warmup))
    _touch(full(warmup))

    with PeakMemory() as memory, PeakMemory("VmRSS") as mapped:
        started = time.perf_counter()
        model = load(checkpoint)
        seconds = time.perf_counter() - started
        _touch(model)
    result = {"peak": memory.peak, "mapped_peak": mapped.peak, "seconds": seconds,
              "local_bytes": local_bytes(model)}
    del model
    if rank == 0:
        with PeakMemory() as memory:
            started = time.perf_counter()
            model = full(checkpoint)
            result["full_seconds"] = time.perf_counter() - started
            _touch(model)
        result["full_peak"] = memory.peak
    return result
