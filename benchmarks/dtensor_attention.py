"""The eager cost of running a stock attention processor on DTensors (`surgery.parallel.dtensor_attention`) against
its head-dim twin (`surgery.core.leaves`), on the same attention module and inputs, per rank of a mesh of 2.

    python benchmarks/dtensor_attention.py                 # MiniMax-H3's attention, 8 heads of 64, 256 tokens
    python benchmarks/dtensor_attention.py --heads 56 --head-dim 128 --tokens 1024   # published width
    python benchmarks/dtensor_attention.py --smoke         # seconds; checks the two paths agree, timings mean nothing

MiniMax-H3's processor reshapes by the stored head count only, so both paths apply to it: `surgery.tensor_parallel`
takes the twin there, and the DTensor path only where no twin can be built (Krea2, Ideogram4). One process on torch's
fake process group (collectives are no-ops: what is measured is each rank's own work, DTensor's per-op dispatch
included); both paths make the same one all-reduce, so their local outputs (partial sums) must be equal, and are
checked. Median of `--repeat` calls after `--warmup`, the two paths interleaved; torch.compile would remove the
dispatch cost, eager mode is what this measures.

Latest CPU run (2 cores shared with other jobs, torch 2.13.0+cpu, 1 thread, fp32, 2026-12-03; the ratio is the
number that travels, not the times):

| width | tokens | twin ms | DTensor ms | DTensor / twin |
|---|---|---|---|---|
| 4 heads x 16 | 64 | 28.33 | 46.52 | 1.64 |
| 8 heads x 64 | 256 | 195.13 | 222.65 | 1.14 |

The DTensor path costs a fixed dispatch per op (about 18 ms per call on this loaded machine): 1.64x the twin on a
tiny attention, 1.14x at 512 wide and 256 tokens, less as the GEMMs grow.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import surgery  # noqa: E402
from surgery.core.registry import families  # noqa: E402
from surgery.parallel.derive import attention_plan, projection_plan  # noqa: E402
from surgery.parallel.distributed import fake_process_group  # noqa: E402
from surgery.parallel.dtensor_attention import ImplicitReplication  # noqa: E402
from surgery.testing import seeded_model  # noqa: E402


def attention_call(heads: int, head_dim: int, tokens: int):
    """MiniMax-H3's first block attention, stock and twin, and the arguments one forward calls it with."""
    family = families()["minimax-h3"]
    config = {**family.tests.configs["tiny"], "num_attention_heads": heads, "attention_head_dim": head_dim,
              "hidden_size": heads * head_dim, "num_layers": 1, "num_refiner_layers": 1,
              "time_embed_hidden_dim": heads * head_dim}
    model = seeded_model(family, config, 0)
    captured = {}
    attn = model.transformer_blocks[0].attn
    hook = attn.register_forward_pre_hook(lambda m, a, k: captured.update(args=a, kwargs=k), with_kwargs=True)
    with torch.no_grad():
        model(**family.example_inputs(config, batch=1, image_tokens=tokens - 16, text_tokens=8), return_dict=False)
    hook.remove()
    stock = copy.deepcopy(attn)
    twin = surgery.unfuse(model).transformer_blocks[0].attn
    return stock, twin, captured["args"], captured["kwargs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.heads, args.head_dim, args.tokens, args.warmup, args.repeat = 4, 16, 32, 1, 2
    torch.set_num_threads(1)
    stock, twin, call_args, call_kwargs = attention_call(args.heads, args.head_dim, args.tokens)
    with fake_process_group(2), torch.no_grad():
        mesh = init_device_mesh("cpu", (2,))
        plan = attention_plan(twin)
        parallelize_module(twin, mesh, plan)
        parallelize_module(stock, mesh, projection_plan(stock, on_dtensors=True))
        parallelize_module(stock, mesh, ImplicitReplication())
        outputs = {"twin": twin(*call_args, **call_kwargs), "DTensor": stock(*call_args, **call_kwargs)}
        difference = (outputs["twin"] - outputs["DTensor"]).abs().max().item()
        assert difference <= 1e-5 * outputs["twin"].abs().max().item(), difference
        times: dict[str, list[float]] = {"twin": [], "DTensor": []}
        for i in range(args.warmup + args.repeat):
            for name, module in (("twin", twin), ("DTensor", stock)):
                start = time.perf_counter()
                module(*call_args, **call_kwargs)
                if i >= args.warmup:
                    times[name].append(1000 * (time.perf_counter() - start))
    twin_ms, dtensor_ms = statistics.median(times["twin"]), statistics.median(times["DTensor"])
    print("| width | tokens | twin ms | DTensor ms | DTensor / twin |\n|---|---|---|---|---|")
    print(f"| {args.heads} heads x {args.head_dim} | {args.tokens} | {twin_ms:.2f} | {dtensor_ms:.2f} | "
          f"{dtensor_ms / twin_ms:.2f} |")
    print(f"local outputs agree to {difference:.1e}")


if __name__ == "__main__":
    main()
