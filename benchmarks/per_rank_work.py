"""Per rank, side by side: fused, unfused, surgery's TP and diffusers' packed TP (`enable_parallelism`'s
`apply_tensor_parallel`) of FLUX.2 or Wan, eager and torch.compile; ms per forward, ratios, GEMMs / cats /
all-reduces per forward and peak memory per rank.

    # one node with N GPUs: FLUX.2-klein-9B and Wan-14B widths, a few blocks, bf16, eager and compiled
    torchrun --nproc-per-node N benchmarks/per_rank_work.py --device cuda --model flux2 --width klein-9b --double 2 --single 4
    torchrun --nproc-per-node N benchmarks/per_rank_work.py --device cuda --model wan --width t2v-14b --double 4
    torchrun --nproc-per-node 2 benchmarks/per_rank_work.py --width dev --double 1 --single 2  # a slice of dev
    python benchmarks/per_rank_work.py --device cpu --tiny --model wan                          # seconds: a smoke run

One process per rank (torchrun; plain `python` is world 1). Every rank builds the same seeded model at the
variant's published width (`--double`: FLUX.2's double-stream blocks or Wan's blocks, `--single`: FLUX.2's
single-stream blocks; default the published depth) and keeps it on the host as the reference, then measures each
form in turn, each built anew from that reference on the device: `fused` and `unfused` whole on every rank,
`surgery TP` (`surgery.unfuse` + `surgery.tensor_parallel`) and `packed TP` (diffusers' packed plan on the fused
model, only where diffusers ships one: FLUX.2, not Wan) over all ranks. Timings are medians of `--repeat` runs after
`--warmup`; ratios come from the same run. Peak memory is torch's allocator peak (`max_memory_allocated`, CUDA only)
over the form's forwards, its weights included, the largest of all ranks. A form whose compiled run fails keeps its
eager numbers and the error in its row. Rank 0 prints the table (and `--json` writes it).

(`torchrun` is `python -m torch.distributed.run`.)

Latest CPU run (2 cores shared with other jobs, torch 2.13.0+cpu, world 2 gloo, klein-4B width, 1 double + 1 single
block, 32 image + 8 text tokens, fp32, 1 warm-up, median of 3): the counts hold on any machine, the times here are
mostly the machine's load (the same model's ratio moved 0.78 -> 1.25 between eager and compiled). Counts are of the
second forward: the first one run for inference lays the `SplitProjection` columns out (docs/per_rank_work.md).

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
from surgery.core.registry import families  # noqa: E402
from surgery.testing import CollectiveCounter, diffusers_packed_tp, leave_together, rel_err  # noqa: E402

# --model -> (the family's registry name, its default --width, its tiny test config for --tiny)
MODELS = {"flux2": ("flux2", "klein-9b", "tp_wide"), "wan": ("wan", "t2v-14b", "tiny")}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="flux2", choices=sorted(MODELS))
    p.add_argument("--width", help="the variant's width: FLUX.2 klein-4b, klein-9b (default), dev; Wan t2v-1.3b, "
                   "t2v-14b (default), ...; or a test config")
    p.add_argument("--tiny", action="store_true", help="the family's tiny test config and 16 tokens: a smoke run")
    p.add_argument("--double", type=int, help="FLUX.2's double-stream blocks, Wan's blocks (default: the variant's)")
    p.add_argument("--single", type=int, help="FLUX.2's single-stream blocks (default: the variant's)")
    p.add_argument("--tokens", type=int, default=None, help="image tokens (text tokens: a quarter); default 4096")
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


def build(form: str, reference: torch.nn.Module, mesh, device: torch.device) -> torch.nn.Module:
    model = copy.deepcopy(reference).to(device)
    if form == "unfused":
        return surgery.unfuse(model)
    if form == "surgery TP":
        return surgery.tensor_parallel(surgery.unfuse(model), mesh, src_data_rank=None)
    if form == "packed TP":
        return diffusers_packed_tp(model, mesh)
    return model


def configure(args) -> tuple:
    """The family, its config at `--width` (or its tiny test config) with the blocks asked for, and the tokens."""
    name, width, tiny = MODELS[args.model]
    family = families()[name]
    args.width = args.width or (tiny if args.tiny else width)
    args.tokens = args.tokens or (16 if args.tiny else 4096)
    known = {**family.tests.configs, **family.variants}
    if args.width not in known:
        raise SystemExit(f"per_rank_work.py: --width {args.width} is not a {args.model} width; known: "
                         f"{', '.join(sorted(known))}")
    config = dict(known[args.width])
    if args.double is not None:
        config["num_layers"] = args.double
    if args.single is not None:
        if "num_single_layers" not in config:
            raise SystemExit(f"per_rank_work.py: {args.model} has no single-stream blocks; drop --single.")
        config["num_single_layers"] = args.single
    return family, config


def main() -> None:
    args = parse()
    family, config = configure(args)
    rank, world, device = setup(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    mesh = init_device_mesh(device.type, (world,))
    # the reference stays on the host: each form is built from it on the device, so a form's peak is its own
    reference = seeded_model(family, config, 0, dtype).eval()
    kw = family.example_inputs(config, batch=1, image_tokens=args.tokens, text_tokens=max(1, args.tokens // 4),
                               seed=0, dtype=dtype, device=device)
    with torch.no_grad():
        expected = build("fused", reference, mesh, device)(**kw, return_dict=False)[0]
    rows = []
    for form in args.forms.split(","):
        if form == "packed TP" and not getattr(reference, "_tp_plan", None):
            continue  # diffusers ships no tensor-parallel plan for this model
        model = build(form, reference, mesh, device)
        peak_reset(device)
        run = lambda m=model: m(**kw, return_dict=False)[0]  # noqa: E731
        with torch.no_grad():
            run()  # the first forward run for inference lays each SplitProjection's columns out, once
            with CollectiveCounter() as counter:
                error = rel_err(run(), expected)
        row = {"form": form, "world": world, **counter.work(), "error": error}
        row["eager ms"] = timed(run, args.warmup, args.repeat, device)
        if not args.no_compile:
            compiled = torch.compile(model)
            try:
                row["compiled ms"] = timed(lambda c=compiled: c(**kw, return_dict=False)[0], args.warmup,
                                           args.repeat, device)
            except Exception as failure:  # noqa: BLE001 - the eager numbers still stand; the table says why
                row["compile error"] = f"{type(failure).__name__}: {(str(failure).splitlines() or [''])[0][:200]}"
                torch._dynamo.reset()
        local = peak(device)
        peaks = [None] * world
        dist.all_gather_object(peaks, local)
        row["peak GiB"] = max(peaks) if local is not None else None
        rows.append(row)
        del model, run
    if rank == 0:
        report(rows, args, config, dtype)
    leave_together()


def report(rows: list[dict], args, config: dict, dtype) -> None:
    by = {r["form"]: r for r in rows}
    blocks = f"{config['num_layers']} blocks"
    if "num_single_layers" in config:
        blocks = f"{config['num_layers']} double + {config['num_single_layers']} single blocks"
    print(f"{args.model} {args.width} width: {blocks}, {args.tokens} image tokens, {dtype}, {args.device}, "
          f"world {rows[0]['world']}")
    keys = ["form", "gemm", "cat", "collective", "eager ms", "compiled ms", "peak GiB", "error", "compile error"]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r.get(k):.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys))
    for a, b in (("unfused", "fused"), ("surgery TP", "packed TP")):
        if a in by and b in by:
            for t in ("eager ms", "compiled ms"):
                if t in by[a] and t in by[b]:
                    print(f"{a} / {b} ({t.split()[0]}): {by[a][t] / by[b][t]:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"config": config, "args": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
