"""What the checkpoint-reliability tests run in other processes: a conversion stopped mid-write, and peak memory.

`python convert_worker.py stall SRC DST MARKER`: converts SRC into DST (--overwrite, small shards, small row blocks),
and after some blocks have been written creates MARKER and sleeps, so the test can SIGKILL it in the middle of a
write.
"""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

import surgery
import surgery.io.safetensors_writer as writer


def stall(src: str, dst: str, marker: str, after: int = 6) -> None:
    write = writer.write_chunk
    calls = [0]

    def stalling(out, chunk):
        write(out, chunk)
        calls[0] += 1
        if calls[0] == after:
            out.flush()
            Path(marker).write_text(out.name)
            time.sleep(600)

    writer.write_chunk = stalling
    writer.BLOCK_BYTES = 64 * 1024
    surgery.state_dict.convert_checkpoint(src, dst, overwrite=True, max_shard_size="1MB")


def convert_peak(rank: int, world: int, src: str, dst: str, warmup_src: str, warmup_dst: str) -> dict:
    """Peak owned memory (RssAnon) of a sharded conversion, after a warm-up conversion of a small checkpoint."""
    from load_worker import PeakMemory

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: freed blocks go back to the system
    surgery.state_dict.convert_checkpoint(warmup_src, warmup_dst, max_shard_size="100KB")
    with PeakMemory() as memory, PeakMemory("VmRSS") as mapped:
        started = time.perf_counter()
        surgery.state_dict.convert_checkpoint(src, dst, max_shard_size="50MB")
        seconds = time.perf_counter() - started
    return {"peak": memory.peak, "mapped_peak": mapped.peak, "seconds": seconds}


if __name__ == "__main__":
    if sys.argv[1] == "stall":
        stall(*sys.argv[2:5])
