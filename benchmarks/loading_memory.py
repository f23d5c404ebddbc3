"""Peak memory of `surgery.load_tensor_parallel` per rank vs diffusers' full load (moved here from the tests).

    python benchmarks/loading_memory.py [--world 2]

A klein-4B-shaped checkpoint at reduced depth (fp32 on disk, loaded as bf16). Each rank samples what it owns
(`RssAnon`) in a thread while loading, after a warm-up load; rank 0 then measures diffusers' `from_pretrained`. These
numbers depend on the allocator, the kernel and the machine's load (a sampling thread can miss a peak), which is why
they are a benchmark and not an assertion.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests" / "workers"), str(HERE.parent / "tests" / "support")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()

    import load_worker
    from flux2_testing import build, small_config
    from surgery_rewrites.flux2 import seeded_model
    from surgery.app.demo import demo_config
    from surgery.testing import run_on_cpu_ranks

    with tempfile.TemporaryDirectory(prefix="surgery-load-bench-") as tmp:
        folder, warmup = Path(tmp) / "klein4b-demo", Path(tmp) / "warmup"
        seeded_model(demo_config("flux2-klein-4b"), 0).save_pretrained(folder)
        build(small_config("tp_wide"), 3).save_pretrained(warmup)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        results = run_on_cpu_ranks(load_worker.peak_memory, args.world, str(folder), str(warmup))
    mb = lambda n: f"{n / 2**20:.0f} MB"  # noqa: E731
    print(f"{mb(size)} fp32 checkpoint loaded as bf16 over {args.world} ranks")
    print(f"diffusers' full load (rank 0): peak {mb(results[0]['full_peak'])} owned, {results[0]['full_seconds']:.2f} s")
    for rank, r in enumerate(results):
        print(f"rank {rank}: peak {mb(r['peak'])} owned (holds {mb(r['local_bytes'])}; {mb(r['mapped_peak'])} with "
              f"mapped file pages), {r['seconds']:.2f} s")


if __name__ == "__main__":
    main()
