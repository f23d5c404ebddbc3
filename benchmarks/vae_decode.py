"""The VAE decoded once across the ranks (`surgery.decode_parallel`) against the whole decode on every rank: decode
time and peak memory per rank, at 2 and 4 gloo CPU ranks.

    python benchmarks/vae_decode.py                          # both VAEs, 2 and 4 ranks (minutes on 2 cores)
    python benchmarks/vae_decode.py --vaes wan --worlds 2    # one VAE, one world

Modes, each in fresh processes (`run_on_cpu_ranks`: spawned ranks, one torch thread each):
- `whole`: diffusers' `vae.decode`, untiled, on every rank (what every rank of a pipeline does without surgery);
- `tiled`: diffusers' tiled decode on every rank (the single-device result `split` reproduces);
- `split`: `surgery.decode_parallel`: each rank decodes its share of the tiles, one gather.

Time: the median of `--repeat` decodes after one warm-up, each started after a barrier, the slowest rank's. Peak
memory per rank: the kernel's peak resident set size of the rank's process over the decodes (`VmHWM` of
/proc/self/status, reset by writing 5 to /proc/self/clear_refs just before; where that reset is refused, the process'
`ru_maxrss`), minus the resident size just before (the weights and latents already there): the decode's own peak,
the largest over ranks. Both hold on a loaded machine (the kernel counts pages, not time), though the times do not: N
ranks share this machine's cores.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import diffusers  # noqa: E402

# name -> class, config (the published layout at a fraction of the width), latents, tile sizes for enable_tiling
VAES = {
    "flux1": ("AutoencoderKL", dict(
        block_out_channels=[32, 64, 64, 64], down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=1, latent_channels=16, norm_num_groups=32,
        sample_size=256), (1, 16, 48, 48), {}),  # a 384x384 image: 4 tiles of 256 (32 latents) every 192
    "wan": ("AutoencoderKLWan", dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                     temperal_downsample=[False, True, True]),
            (1, 16, 3, 24, 24),  # 9 frames of 192x192: 9 tiles of 96 every 64, 3 frame chunks each
            dict(tile_sample_min_height=96, tile_sample_min_width=96, tile_sample_stride_height=64,
                 tile_sample_stride_width=64)),
}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure(rank: int, world: int, name: str, mode: str, repeat: int) -> dict:
    import surgery
    from torch.distributed.device_mesh import init_device_mesh

    cls, config, shape, tiles = VAES[name]
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    vae = getattr(diffusers, cls)(**config).eval()
    vae.enable_tiling(**tiles)
    if mode != "tiled":
        vae.disable_tiling()
    if mode == "split":
        surgery.decode_parallel(vae, mesh)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    before = _status_kib("VmRSS")
    reset = _reset_peak()
    times = []
    with torch.no_grad():
        for _ in range(repeat + 1):
            dist.barrier()
            start = time.perf_counter()
            out = vae.decode(latents).sample
            times.append(time.perf_counter() - start)
    peak = _status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": statistics.median(times[1:]), "peak MiB": (peak - before) / 1024, "shape": tuple(out.shape),
            "method": "VmHWM" if reset else "ru_maxrss", "checksum": float(out.double().sum())}


def main() -> None:
    from surgery.testing import run_on_cpu_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vaes", default=",".join(VAES))
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args()
    rows = []
    for name in args.vaes.split(","):
        for world in map(int, args.worlds.split(",")):
            by = {}
            for mode in ("whole", "tiled", "split"):
                ranks = run_on_cpu_ranks(measure, world, name, mode, args.repeat, timeout=3600)
                by[mode] = {"seconds": max(r["seconds"] for r in ranks), "peak MiB": max(r["peak MiB"] for r in ranks),
                            "checksum": ranks[0]["checksum"], "shape": ranks[0]["shape"],
                            "method": ranks[0]["method"]}
            rows.append((name, world, by))
            print_rows(rows[-1:], header=len(rows) == 1)
    print(f"\npeak memory: {rows[0][2]['split']['method']}; torch {torch.__version__}, diffusers "
          f"{diffusers.__version__}, {len(__import__('os').sched_getaffinity(0))} cores")


def print_rows(rows, header: bool) -> None:
    if header:
        print("| VAE | output | ranks | whole s | tiled s | split s | split / tiled | split / whole "
              "| whole MiB | tiled MiB | split MiB | split = tiled |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, world, by in rows:
        w, t, s = by["whole"], by["tiled"], by["split"]
        print(f"| {name} | {'x'.join(map(str, s['shape'][1:]))} | {world} | {w['seconds']:.2f} | {t['seconds']:.2f} | "
              f"{s['seconds']:.2f} | {s['seconds'] / t['seconds']:.2f} | {s['seconds'] / w['seconds']:.2f} | "
              f"{w['peak MiB']:.0f} | {t['peak MiB']:.0f} | {s['peak MiB']:.0f} | "
              f"{'yes' if s['checksum'] == t['checksum'] else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
