"""Per rank, side by side: fused, unfused, surgery's TP and diffusers' packed TP (`enable_parallelism`'s
`apply_tensor_parallel`) of FLUX.2, eager and torch.compile; ms per forward, ratios, GEMMs / cats / all-reduces per
forward and peak memory per rank.

    torchrun --nproc-per-node 8 benchmarks/per_rank_work.py --device cuda --width klein-9b  # one node, TP 8
    torchrun --nproc-per-node 2 benchmarks/per_rank_work.py --width dev --double 1 --single 2  # a slice of dev
    python benchmarks/per_rank_work.py --width klein-4b --double 1 --single 1 --tokens 64     # CPU, one process

One process per rank (torchrun; plain `python` is world 1). Every rank builds the same seeded model at the
variant's width (`--double`/`--single` blocks, default the published depth) on its device, then measures each form
in turn: `fused` and `unfused` whole on every rank, `surgery TP` (`surgery.unfuse` + `surgery.tensor_parallel`) and
`packed TP` (diffusers' packed plan on the fused model) over all ranks. Timings are medians of `--repeat` runs after
`--warmup`; ratios come from the same run. Rank 0 prints the table (and `--json` writes it).

(`torchrun` is `python -m torch.distributed.run`.)

Latest CPU run (2 cores shared with other jobs, torch 2.13.0+cpu, world 2 gloo, klein-4B width, 1 double + 1 single
block, 32 image + 8 text tokens, fp32, 1 warm-up, median of 3): the counts hold on any machine, the times here are
mostly the machine's load (the same model's ratio moved 0.78 -> 1.25 between eager and compiled). Measured while
`SplitProjection` also ran one GEMM; it now runs two (24 GEMMs for unfused and surgery TP here, see
docs/per_rank_work.md).

| form | GEMMs | cats | all-reduces | eager ms | compiled ms |
|---|---|---|---|---|---|
| fused | 23 | 17 | 0 | 1716 | 1403 |
| unfused | 23 | 17 | 0 | 1345 | 1753 |
| surgery TP | 23 | 17 | 5 | 765 | 597 |
| packed TP | 23 | 17 | 5 | 978 | 873 |

unfused / fused: 0.78 eager, 1.25 compiled; surgery TP / packed TP: 0.78 eager, 0.68 compiled.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import surgery  # noqa: E402
from surgery.core.build import seeded_model  # noqa: E402
from surgery.testing import CollectiveCounter, diffusers_packed_tp, rel_err  # noqa: E402
from surgery_rewrites.flux2 import FAMILY, example_inputs  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", default="klein-9b", choices=sorted(FAMILY.variants) + sorted(FAMILY.test_configs),
                   help="FLUX.2 variant's width (or a tiny test config, for a smoke run)")
    p.add_argument("--double", type=int, help="double-stream blocks (default: the variant's)")
    p.add_argument("--single", type=int, help="single-stream blocks (default: the variant's)")
    p.add_argument("--tokens", type=int, default=4096, help="image tokens (text tokens: a quarter)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on cuda) or float32 (default on cpu)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--forms", default="fused,unfused,surgery TP,packed TP")
    p.add_argument("--json", type=Path, help="write the rows here (rank 0)")
    return p.parse_args()


def setup(device: str) -> tuple[int, int, torch.device]:
    if "WORLD_SIZE" in os.environ:
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend)
    else:  # plain python: a group of one, joined through a file store
        store = dist.FileStore(tempfile.mktemp(prefix="per-rank-work-"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        return rank, world, torch.device("cuda", torch.cuda.current_device())
    return rank, world, torch.device(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def timed(fn, warmup: int, repeat: int, device: torch.device) -> float:
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        sync(device)
        times = []
        for _ in range(repeat):
            dist.barrier()
            start = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def build(args, form: str, fused: torch.nn.Module, mesh) -> torch.nn.Module:
    model = copy.deepcopy(fused)
    if form == "unfused":
        return surgery.unfuse(model)
    if form == "surgery TP":
        return surgery.tensor_parallel(surgery.unfuse(model), mesh, src_data_rank=None)
    if form == "packed TP":
        return diffusers_packed_tp(model, mesh)
    return model


def main() -> None:
    args = parse()
    rank, world, device = setup(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    config = dict({**FAMILY.test_configs, **FAMILY.variants}[args.width])
    if args.double is not None:
        config["num_layers"] = args.double
    if args.single is not None:
        config["num_single_layers"] = args.single
    mesh = init_device_mesh(device.type, (world,))
    fused = seeded_model(FAMILY, config, 0, dtype).to(device).eval()
    kw = example_inputs(config, batch=1, image_tokens=args.tokens, text_tokens=max(1, args.tokens // 4), seed=0,
                        dtype=dtype, device=device)
    with torch.no_grad():
        expected = fused(**kw, return_dict=False)[0]
    rows = []
    for form in args.forms.split(","):
        peak_reset(device)
        model = build(args, form, fused, mesh)
        run = lambda m=model: m(**kw, return_dict=False)[0]  # noqa: E731
        with torch.no_grad(), CollectiveCounter() as counter:
            error = rel_err(run(), expected)
        row = {"form": form, "world": world, **counter.work(), "error": error}
        row["eager ms"] = timed(run, args.warmup, args.repeat, device)
        if not args.no_compile:
            compiled = torch.compile(model)
            row["compiled ms"] = timed(lambda: compiled(**kw, return_dict=False)[0], args.warmup, args.repeat, device)
        row["peak GiB"] = peak(device)
        rows.append(row)
        del model
    if rank == 0:
        report(rows, args, config, dtype)
    dist.destroy_process_group()


def report(rows: list[dict], args, config: dict, dtype) -> None:
    by = {r["form"]: r for r in rows}
    print(f"FLUX.2 {args.width} width: {config['num_layers']} double + {config['num_single_layers']} single blocks, "
          f"{args.tokens} image tokens, {dtype}, {args.device}, world {rows[0]['world']}")
    keys = ["form", "gemm", "cat", "collective", "eager ms", "compiled ms", "peak GiB", "error"]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r.get(k):.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys))
    for a, b in (("unfused", "fused"), ("surgery TP", "packed TP")):
        if a in by and b in by:
            for t in ("eager ms", "compiled ms"):
                if t in by[a]:
                    print(f"{a} / {b} ({t.split()[0]}): {by[a][t] / by[b][t]:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"config": config, "args": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
