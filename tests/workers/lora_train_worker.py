"""What each of 4 gloo ranks runs for tests/integration/test_lora_train.py: the core of examples/train_lora_tp.py (TP 2 x
FSDP2 2, LoRA on the unfused layers, surgery.lora.shard_lora) against the same steps on one device; then the saved
adapter in stock diffusers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh

from surgery.testing import rel_err

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lora_tp.py"


def example():
    if "train_lora_tp" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_lora_tp", EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["train_lora_tp"] = module
    return sys.modules["train_lora_tp"]


def worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(rel_err(a[n], b[n]) for n in a)


# AdamW with a large eps: its step is nearly linear in the gradient (not sign(g) as with a tiny eps), so one device
# and TP x FSDP2 agree tightly, and lora_B (zero at the start) moves far from where a skipped step leaves it
SETTINGS = {"sgd": ["--optimizer", "sgd", "--lr", "0.5"], "adamw": ["--optimizer", "adamw", "--lr", "1e-2",
                                                                    "--eps", "1e-1"]}


def run(rank: int, world: int, shared: str) -> dict:
    ex = example()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for name, flags in SETTINGS.items():
        args = ex.parse_args(["--steps", "2", *flags])
        base, family = ex.base_model(args, torch.device("cpu"))
        sharded = ex.train(args, mesh, base, family)
        reference = ex.train_one_device(args, base, family, sharded["initial"])
        out[name] = {
            "trained": worst(sharded["trained"], reference["trained"]),
            # what a skipped (or lost) step leaves: the initial factors
            "skipped step": worst(sharded["initial"], reference["trained"]),
            "factors": len(sharded["trained"]),
            "placements": sorted({str(p.placements) for n, p in sharded["model"].named_parameters()
                                  if "lora_" in n}),
        }
        if name == "adamw":
            folder = Path(shared) / "adapter"
            sharded["model"].save_lora_adapter(folder)
            torch.distributed.barrier()
            if rank == 0:  # stock diffusers loads it into the stock (fused) model: the trained model's outputs
                import copy

                from surgery.testing import example_inputs

                stock = copy.deepcopy(base)
                stock.load_lora_adapter(folder, prefix=None, weight_name="pytorch_lora_weights.safetensors")
                kw = example_inputs(family, dict(base.config), batch=1, seed=7)
                reference["model"].eval()
                with torch.no_grad():
                    out["stock load of the saved adapter"] = rel_err(stock(**kw, return_dict=False)[0],
                                                                     reference["model"](**kw, return_dict=False)[0])
                    out["adapter changes the output"] = rel_err(base(**kw, return_dict=False)[0],
                                                                reference["model"](**kw, return_dict=False)[0])
    return out
