"""Memory per rank while loading a LoRA adapter on a tensor-parallel model, at published width.

    python benchmarks/lora_tp.py                       # FLUX.2 klein-4B width, 1 double + 1 single block, bf16, r=64
    python benchmarks/lora_tp.py --variant dev --rank 64 --tp 2
    python benchmarks/lora_tp.py --smoke               # seconds: a tiny model (what a CI smoke run would take)

Each measurement runs in fresh processes (one per rank, gloo). Each rank builds its shard of the model (meta ->
`tensor_parallel` with `src_data_rank=None` -> `to_empty`: only the shards are allocated), then resets its kernel
high-water mark (`/proc/self/clear_refs` = 5) and loads the adapter; the increase of `VmHWM` over `VmRSS` before the
load is the load's peak (glibc's mmap threshold fixed at 64 KiB in those processes, so that blocks freed earlier
are not reused silently). Ways of loading compared:

- `file (sliced)`: `transformer.load_lora_adapter(folder)` on the sharded model: each rank reads only its slices.
- `state dict (pipeline)`: what `pipe.load_lora_weights(folder)` does: diffusers' `lora_state_dict` reads the whole
  file on every rank first, then the sharded load slices it.

Measured (2 cores, klein-4B width, 1 + 1 blocks, bf16, rank 64, TP 2; adapter 19.9 MiB, largest factor 3.4 MiB,
each rank's share 15.2 MiB): peak over RSS before the load 12.5 MiB on each rank, both ways. The increase stays below
the share itself, so this metric undercounts here (resident pages freed before the load and reused; safetensors
slices read through mmap); the exact claim — each rank reads only its share, element for element — is asserted in
tests/integration/test_lora_tp.py (elements read == elements held < elements in the file).

Reported beside: the adapter file's size, this rank's share of the adapter (its local factors), the largest factor.
Results go to benchmarks/results/lora_tp.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import surgery  # noqa: E402
from surgery.core.registry import model_class  # noqa: E402
from surgery.testing import run_on_cpu_ranks  # noqa: E402


PEAK, SHARE, MODEL = "peak over RSS before the load", "rank's share of the adapter", "rank's model bytes"


def status(field: str) -> int:
    """A `/proc/self/status` field in bytes (VmHWM, VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def build_config(args) -> dict:
    family = surgery.extend.families()[args.family]
    if args.smoke:
        return dict(family.tests.configs["dev_small" if args.family == "flux2" else "tp_dev"])
    return dict(family.config(args.variant), num_layers=1, num_single_layers=1)


def stock_targets(model) -> list[str]:
    return sorted(n for n, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and "transformer_blocks." in n)


def write_adapter(args, folder: Path) -> dict:
    """A rank-`args.rank` adapter on every block Linear of the stock model (random bf16 factors), as published."""
    from diffusers import Flux2Pipeline, FluxPipeline

    family = surgery.extend.families()[args.family]
    with torch.device("meta"):
        model = model_class(family)(**build_config(args))
    generator = torch.Generator().manual_seed(0)
    layers = {}
    for name in stock_targets(model):
        linear = model.get_submodule(name)
        layers[f"{name}.lora_A.weight"] = (torch.randn(args.rank, linear.in_features, generator=generator)
                                           * 0.01).to(torch.bfloat16)
        layers[f"{name}.lora_B.weight"] = (torch.randn(linear.out_features, args.rank, generator=generator)
                                           * 0.01).to(torch.bfloat16)
    pipe = Flux2Pipeline if args.family == "flux2" else FluxPipeline
    config = {"r": args.rank, "lora_alpha": args.rank, "target_modules": stock_targets(model)}
    pipe.save_lora_weights(folder, transformer_lora_layers=layers, transformer_lora_adapter_metadata=config)
    sizes = [t.numel() * t.element_size() for t in layers.values()]
    return {"adapter tensors": len(layers), "adapter bytes": sum(sizes), "largest factor bytes": max(sizes),
            "file bytes": (folder / "pytorch_lora_weights.safetensors").stat().st_size}


def measure(rank: int, world: int, args, folder: str, how: str) -> dict:
    from diffusers import Flux2Pipeline, FluxPipeline
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    family = surgery.extend.families()[args.family]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = model_class(family)(**build_config(args)).to(torch.bfloat16)
    surgery.tensor_parallel(surgery.unfuse(model), mesh, src_data_rank=None)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).normal_(0, 0.01)
    model_bytes = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())
    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    if how == "file (sliced)":
        model.load_lora_adapter(folder, adapter_name="a", weight_name="pytorch_lora_weights.safetensors")
    else:
        pipe = Flux2Pipeline if args.family == "flux2" else FluxPipeline
        state_dict, metadata = pipe.lora_state_dict(folder, return_lora_metadata=True)
        if isinstance(state_dict, tuple):
            state_dict = state_dict[0]
        model.load_lora_adapter(state_dict, adapter_name="a", metadata=metadata)
        del state_dict
    peak = status("VmHWM") - before
    after = status("VmRSS") - before
    share = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes
                for n, p in model.named_parameters() if "lora_" in n)
    return {PEAK: peak, SHARE: share, MODEL: model_bytes, "RSS after - before": after, "RSS before": before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="flux2", choices=["flux2", "flux1"])
    parser.add_argument("--variant", default="klein-4b")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.rank = 4
    # glibc returns every block over 64 KiB to the kernel when freed (no dynamic threshold, no arena reuse of big
    # frees), so the high-water mark shows what the load itself allocates, not what earlier frees left behind
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    with tempfile.TemporaryDirectory(prefix="surgery-lora-bench-") as tmp:
        folder = Path(tmp) / "adapter"
        info = write_adapter(args, folder)
        rows = {}
        for how in ("file (sliced)", "state dict (pipeline)"):
            rows[how] = run_on_cpu_ranks(measure, args.tp, args, str(folder), how)
    mib = 2 ** 20
    lines = [f"# LoRA load on a sharded model: {args.family} {'smoke' if args.smoke else args.variant} width, "
             f"{'tiny config' if args.smoke else '1 double + 1 single block'}, bf16, rank {args.rank}, TP {args.tp}", "",
             f"adapter: {info['adapter tensors']} tensors, {info['adapter bytes'] / mib:.1f} MiB "
             f"(file {info['file bytes'] / mib:.1f} MiB), largest factor {info['largest factor bytes'] / mib:.2f} MiB",
             "", "| load | rank | peak over RSS before (MiB) | RSS after - before (MiB) | rank's share of the adapter "
             "(MiB) | share + largest factor (MiB) | rank's model (MiB) |", "|---|---|---|---|---|---|---|"]
    for how, ranks in rows.items():
        for r, m in enumerate(ranks):
            share, model = m[SHARE], m[MODEL]
            lines.append(f"| {how} | {r} | {m[PEAK] / mib:.1f} | {m['RSS after - before'] / mib:.1f} | "
                         f"{share / mib:.1f} | {(share + info['largest factor bytes']) / mib:.1f} | {model / mib:.0f} |")
    text = "\n".join(lines)
    print(text)
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    name = "lora_tp_smoke" if args.smoke else "lora_tp"
    (out / f"{name}.md").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps({"args": vars(args), "adapter": info, "ranks": rows}, indent=2))


if __name__ == "__main__":
    main()
