"""What each gloo rank runs for the save tests: write a tensor-parallel model, read it back with stock diffusers."""

from __future__ import annotations

import copy
import ctypes
import gc
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers import Flux2Transformer2DModel
from torch.distributed.device_mesh import init_device_mesh

import surgery
from flux2_testing import build, small_config
from surgery.sight.report import local_bytes


def _mismatched(folder: str, reference: torch.nn.Module) -> list[str]:
    """Keys of `folder` (read by stock `from_pretrained`) that differ from `reference`'s, bitwise, in dtype or shape."""
    loaded = Flux2Transformer2DModel.from_pretrained(folder, torch_dtype=reference.dtype)
    got, want = loaded.state_dict(), reference.state_dict()
    return sorted(set(got) ^ set(want)) + [
        k for k, v in want.items() if k in got and (got[k].dtype != v.dtype or not torch.equal(got[k], v))
    ]


def round_trip(rank: int, world: int, root: str, name: str, seed: int, dtype_name: str) -> dict:
    """Save a TP model (sharded in memory, then loaded sharded from that save) three ways; rank 0 compares."""
    mesh = init_device_mesh("cpu", (world,))
    dtype = getattr(torch, dtype_name)
    fused = build(small_config(name), seed, dtype)
    model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), mesh, src_data_rank=None)
    root = Path(root)
    surgery.save_pretrained(model, root / "tp", max_shard_size="40KB")
    model.save_pretrained(root / "tp-method", max_shard_size="40KB")  # diffusers' verb, every rank
    loaded = surgery.load_tensor_parallel(None, root / "tp", mesh, progress=False)
    surgery.save_pretrained(loaded, root / "tp-loaded")
    dist.barrier()
    result = {}
    if rank == 0:
        fused.save_pretrained(root / "stock", max_shard_size="40KB")
        result = {key: _mismatched(str(root / key), fused) for key in ("tp", "tp-method", "tp-loaded")}
        result["files"] = sorted(p.name for p in (root / "tp").iterdir())
        result["stock_files"] = sorted(p.name for p in (root / "stock").iterdir())
        result["index"] = (root / "tp" / "diffusion_pytorch_model.safetensors.index.json").read_text()
        result["stock_index"] = (root / "stock" / "diffusion_pytorch_model.safetensors.index.json").read_text()
        result["leftovers"] = sorted(p.name for p in root.iterdir() if p.name.startswith("."))
    return result


def peak_memory(rank: int, world: int, root: str) -> dict:
    """Peak owned memory of this rank while `surgery.save_pretrained` writes a TP model (klein-4B-shaped, reduced
    depth, bf16), with this rank's shard and the largest tensor for scale."""
    from surgery_rewrites.flux2 import seeded_model
    from surgery.app.demo import demo_config

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: freed buffers go back to the system
    mesh = init_device_mesh("cpu", (world,))
    fused = seeded_model(demo_config("flux2-klein-4b"), 0, torch.bfloat16)
    largest = max(p.nbytes for p in fused.parameters())
    model = surgery.tensor_parallel(surgery.unfuse(fused), mesh, src_data_rank=None)
    del fused
    surgery.save_pretrained(model, Path(root) / "warmup", max_shard_size="100MB")  # lazy imports, one-time buffers
    gc.collect()
    # the kernel's own high-water mark, reset here (Linux: "5" to clear_refs), so that a peak between two samples of
    # a sampling thread is not missed and the model's build before does not count
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    start = _status("VmRSS")
    surgery.save_pretrained(model, Path(root) / "measured", max_shard_size="100MB")
    peak = _status("VmHWM") - start
    size = sum(f.stat().st_size for f in (Path(root) / "measured").glob("*.safetensors"))
    return {"peak": peak, "local_bytes": local_bytes(model), "largest_tensor": largest, "checkpoint": size}


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(f"{field}:")).split()[1]) * 1024


def lora_checks(rank: int, world: int, root: str) -> dict:
    """A stock LoRA merged before sharding, then another loaded after sharding, give the stock model's outputs."""
    from flux2_testing import add_random_adapter, forward
    from peft.utils import get_peft_model_state_dict

    mesh = init_device_mesh("cpu", (world,))
    config = small_config("tp_wide")
    from flux2_testing import inputs, rel_err

    kw = inputs(config, 0)
    trained = add_random_adapter(build(config, 0), "a", 0)
    adapter = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(trained, adapter_name="a").items()}
    metadata = {f"transformer.{k}": v for k, v in trained.peft_config["a"].to_dict().items()}
    stock = build(config, 0)
    stock.load_lora_adapter(adapter, adapter_name="a", metadata=metadata)  # as lora_state_dict hands it over
    model = surgery.unfuse(build(config, 0))
    model.load_lora_adapter(adapter, adapter_name="a", metadata=metadata)
    model.fuse_lora()
    model.unload_lora()
    surgery.tensor_parallel(model, mesh, src_data_rank=None)
    result = {"lora_merged_before_sharding": rel_err(forward(model, kw), forward(stock, kw)),
              "lora_vs_trained": rel_err(forward(stock, kw), forward(trained, kw))}
    # and one loaded after sharding, unmerged (tests/integration/test_lora_tp.py covers the rest)
    model.load_lora_adapter(adapter, adapter_name="b", metadata=metadata)
    stock.load_lora_adapter(adapter, adapter_name="b", metadata=metadata)
    model.set_adapters(["b"])
    stock.set_adapters(["a", "b"])
    result["lora_after_sharding"] = rel_err(forward(model, kw), forward(stock, kw))
    folder = Path(root) / "hub"
    try:
        model.save_pretrained(folder, push_to_hub=True)
        result["push_to_hub_error"] = ""
    except surgery.SurgeryError as e:
        result["push_to_hub_error"] = str(e)
    result["push_to_hub_folder"] = folder.exists()
    return result


def all_checks(rank: int, world: int, root: str) -> dict:
    """Everything the TP save tests need, in one spawned job."""
    result = {}
    for dtype in ("float32", "bfloat16"):
        folder = Path(root) / dtype
        if rank == 0:
            folder.mkdir()
        dist.barrier()
        result[dtype] = round_trip(rank, world, str(folder), "tp_wide", 0, dtype)
    result.update(lora_checks(rank, world, root))
    return result
