"""What each gloo rank runs for the published-width tier (`tests/families/test_published_width.py`).

One job per family walks every user path on a model of the published width (the widest published config of the
family, reduced only in depth: one block of each kind, or none), in bf16, against the single-device fused model:
unfuse / fuse, LoRA loading on the unfused model, `tensor_parallel` with `src_data_rank` None and 0,
`surgery.save_pretrained` of the TP model, `load_tensor_parallel` of both layouts, `surgery convert` both ways,
`context_parallel`, and the demo's rank code. Checkpoints are compared with the fused model tensor by tensor, by a
hash of their bytes (bitwise); outputs by `rel_err`. Several paths share one job so that the model is built once.
"""

from __future__ import annotations

import copy
import hashlib
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import surgery
from surgery.sight.report import local
from surgery.core.build import build
from surgery.core.registry import families
from surgery.testing import CollectiveCounter, rel_err

DTYPE = torch.bfloat16
TOKENS = dict(image_tokens=16, text_tokens=8)


def published_config(family_name: str, variant: str, depth: dict) -> dict:
    """The published config of `variant` with only its block counts replaced by `depth`."""
    config = families()[family_name].config(variant)
    for key, value in depth.items():
        if key not in config:
            raise KeyError(f"{family_name}-{variant} has no {key!r}")
        config[key] = value
    return config


PERIOD = 1_000_003  # a prime: no two rows of any published weight (< 10**6 rows) start at the same phase


def fast_seeded(family, config: dict, seed: int = 0, dtype: torch.dtype = DTYPE) -> torch.nn.Module:
    """`seeded_model`'s distribution (matrices N(0, 1/fan_in), vectors N(1, 0.1)) at a fraction of its cost: the
    model is built without its initializers (parameters on meta, buffers real) and each parameter is filled from one
    seeded normal block of prime length, read from a random phase. Building a published-width model with
    `seeded_model` costs ~25 s per GB on one core; this ~2 s."""
    from accelerate import init_empty_weights

    from surgery.core.build import default_dtype, self_scaled

    generator = torch.Generator().manual_seed(seed)
    block = torch.randn(2 * PERIOD, generator=generator).to(dtype)
    with default_dtype(dtype), init_empty_weights():
        model = build(family, config)
    scaled = {f"{path}.weight" for path, module in model.named_modules() if self_scaled(module)}
    for name, param in list(model.named_parameters()):
        n = param.numel()
        start = int(torch.randint(PERIOD, (), generator=generator))
        period = block[start:start + PERIOD]
        if param.dim() > 1:  # N(0, 1) where the module scales its weight itself (`self_scaled`)
            # an empty matrix has no fan-in to scale by (Krea2's text-fusion projector, 1 x 0 in a run without those blocks)
            period = period if name in scaled or n == 0 else period * param.shape[-1] ** -0.5
        else:
            period = period * 0.1 + 1.0
        value = torch.empty(n, dtype=dtype)
        for at in range(0, n, PERIOD):
            value[at:at + PERIOD] = period[:min(PERIOD, n - at)]
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(value.view(param.shape), requires_grad=True))
    return model.eval()


def status(field: str) -> int:
    """A line of /proc/self/status in bytes (VmHWM: the kernel's high-water mark of this process's resident set)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def reset_peak() -> int:
    """Reset this process's VmHWM to its current resident set (Linux `clear_refs` 5); returns that resident set."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def _hash(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data, digest_size=16).hexdigest() + f" {tuple(tensor.shape)} {tensor.dtype}"


def hashes(state_dict: dict) -> dict[str, str]:
    return {k: _hash(v) for k, v in state_dict.items()}


def checkpoint_hashes(folder: Path) -> dict[str, str]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                out[key] = _hash(f.get_tensor(key))
    return out


def differing(got: dict, want: dict) -> list[str]:
    """Keys missing on either side or with other bytes (first few)."""
    return (sorted(set(got) ^ set(want)) + sorted(k for k in want if k in got and got[k] != want[k]))[:5]


def mismatched_locals(model, reference) -> list[str]:
    """Parameters whose placement, dtype or local bytes differ between two TP models."""
    out = []
    for n, p in reference.named_parameters():
        q = model.get_parameter(n)
        if type(p) is not type(q) or (isinstance(p, DTensor) and p.placements != q.placements) \
                or p.dtype != q.dtype or not torch.equal(local(p), local(q)):
            out.append(n)
    return out[:5]


def forward(model, kw) -> torch.Tensor:
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]


def stock_lora(fused, family_name: str) -> tuple[dict, dict, torch.Tensor]:
    """A random stock-named adapter on the fused model: its state dict, metadata, and the stock output with it."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    targets = LORA_TARGETS[family_name]
    fused.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=targets), adapter_name="a")
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in fused.named_parameters():
            if ".a." in name and "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    adapter = {f"transformer.{k}": v.clone() for k, v in get_peft_model_state_dict(fused, adapter_name="a").items()}
    metadata = {f"transformer.{k}": v for k, v in fused.peft_config["a"].to_dict().items()}
    return adapter, metadata, None


# Stock names of the fused Linears (and their neighbours), as a LoRA written for the stock model targets them.
LORA_TARGETS = {
    "flux2": r".*(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out|to_qkv_mlp_proj|"
             r"single_transformer_blocks\.\d+\.attn\.to_out|linear_in|linear_out)$",
    "flux1": r".*(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out|proj_mlp|single_transformer_blocks\.\d+\.proj_out|"
             r"ff\.net\.2)$",
    "hunyuan-video": r".*(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out|proj_mlp|"
                     r"single_transformer_blocks\.\d+\.proj_out)$",
}


def user_paths(rank: int, world: int, family_name: str, variant: str, depth: dict, root: str, paths: tuple) -> dict:
    """The user `paths` at published width on this rank; rank 0 also checks the files (all ranks see `root`).

    Paths: "unfuse" (unfuse / fuse, LoRA), "tp" (tensor_parallel None and 0), "files" (save_pretrained of the TP
    model, load_tensor_parallel of both layouts, convert both ways), "cp" (context_parallel), "demo"."""
    family = families()[family_name]
    config = published_config(family_name, variant, depth)
    root = Path(root)
    mesh = init_device_mesh("cpu", (world,))
    r: dict = {"seconds": {}}
    clock = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        r["seconds"][name] = round(now - clock[0], 1)
        clock[0] = now

    if "peak" in paths:
        import ctypes

        # a freed tensor goes back to the system, instead of staying in malloc's heap (and counting) until reused
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    kw = family.example_inputs(config, batch=1, seed=0, dtype=DTYPE, **TOKENS)
    model = fast_seeded(family, config)
    r["parameters"] = sum(p.numel() for p in model.parameters())
    r["largest"] = max(p.numel() for p in model.parameters())
    r["model_bytes"] = sum(p.nbytes for p in model.parameters())
    blocks: dict[str, int] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[0].endswith("blocks"):
            blocks[".".join(parts[:2])] = blocks.get(".".join(parts[:2]), 0) + p.nbytes
    r["largest_block"] = max(blocks.values())
    expected = forward(model, kw)
    lap("build + fused forward")
    fused_hashes = hashes(model.state_dict()) if rank == 0 and "files" in paths else {}

    # LoRA, the stock way, on the unfused model (rank 0: a single-device path)
    if rank == 0:
        adapter, metadata, _ = stock_lora(model, family_name)
        with_lora = forward(model, kw)
        model.unload_lora()
    lap("lora on fused")

    surgery.unfuse(model)
    unfused_out = forward(model, kw)
    r["unfuse"] = rel_err(unfused_out, expected)
    if rank == 0:
        model.load_lora_adapter(adapter, adapter_name="a", metadata=metadata)
        r["lora"] = rel_err(forward(model, kw), with_lora)
        r["lora_changes_output"] = rel_err(with_lora, expected)
        model.unload_lora()
        r["lora_unloaded"] = torch.equal(forward(model, kw), unfused_out)
        unfused_hashes = hashes(model.state_dict()) if "files" in paths else {}
    surgery.fuse(model)
    r["fuse_bitwise_forward"] = torch.equal(forward(model, kw), expected)
    r["fuse_classes"] = sorted({type(m).__module__.split(".")[0] for m in model.modules()} - {"torch", "diffusers"})
    if rank == 0 and fused_hashes:
        r["fuse_bitwise_weights"] = differing(hashes(model.state_dict()), fused_hashes)
    surgery.unfuse(model)
    lap("unfuse / fuse / lora")

    # tensor_parallel, src_data_rank=None: no weight collective; the rank's peak above what it held before
    held = reset_peak()
    surgery.tensor_parallel(model, mesh, src_data_rank=None)
    r["tp_none_peak"] = status("VmHWM") - held
    r["sharded_bytes"] = sum(p.nbytes for p in model.parameters() if isinstance(p, DTensor)
                             and p.placements[0].is_shard())
    with CollectiveCounter() as counter:
        r["tp_none"] = rel_err(forward(model, kw), expected)
    r["all_reduces"] = counter.counts.get("all_reduce", 0)
    r["expected_all_reduces"] = family.tp.all_reduces(config) if family.tp.all_reduces else None
    lap("tensor_parallel(None)")

    if "files" in paths:
        # surgery.save_pretrained of the TP model -> the stock fused checkpoint, bitwise
        surgery.save_pretrained(model, root / "tp", max_shard_size="1GB")
        dist.barrier()
        if rank == 0:
            r["save"] = differing(checkpoint_hashes(root / "tp"), fused_hashes)
            r["save_files"] = sorted(p.name for p in (root / "tp").iterdir())
        lap("save_pretrained(TP)")

        # load_tensor_parallel of the fused checkpoint == the TP model, bitwise
        loaded = surgery.load_tensor_parallel(None, root / "tp", mesh, progress=False)
        r["load_fused"] = mismatched_locals(loaded, model)
        del loaded
        lap("load_tensor_parallel(fused)")

        # surgery convert both ways (rank 0), then load the unfused layout
        if rank == 0:
            surgery.state_dict.convert_checkpoint(root / "tp", root / "unfused", max_shard_size="1GB")
            r["convert_unfused"] = differing(checkpoint_hashes(root / "unfused"), unfused_hashes)
            surgery.state_dict.convert_checkpoint(root / "unfused", root / "fused", to="fused", max_shard_size="1GB")
            r["convert_fused"] = differing(checkpoint_hashes(root / "fused"), fused_hashes)
            shutil.rmtree(root / "fused")
        dist.barrier()
        loaded = surgery.load_tensor_parallel(None, root / "unfused", mesh, progress=False)
        r["load_unfused"] = mismatched_locals(loaded, model)
        del loaded
        lap("convert both ways + load_tensor_parallel(unfused)")
    del model

    # tensor_parallel, src_data_rank=0: rank 1 holds other weights, and ends up with rank 0's
    model = fast_seeded(family, config, seed=rank)
    surgery.unfuse(model)
    held = reset_peak()
    surgery.tensor_parallel(model, mesh, src_data_rank=0)
    r["tp_zero_peak"] = status("VmHWM") - held
    r["tp_zero"] = rel_err(forward(model, kw), expected)
    del model
    lap("tensor_parallel(0)")

    if "cp" in paths:  # context_parallel (Ulysses over both ranks) of the unfused model
        model = surgery.unfuse(fast_seeded(family, config))
        cp_kw = CP_INPUTS.get(family_name, lambda kw: kw)(kw)
        surgery.context_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
        r["context_parallel"] = rel_err(forward(model, cp_kw), expected)
        del model
        lap("context_parallel")

    if "demo" in paths:  # the demo's rank code (`surgery demo`): seeded fused reference, unfuse, tensor_parallel(None), compare
        from surgery.app.demo import tp_rank

        result = tp_rank(rank, world, family_name, config, 0, "bfloat16", tuple(TOKENS.values()))
        r["demo"] = result["error"]
        lap("demo rank")
    dist.barrier()
    return r


def _batched_ids(kw: dict) -> dict:
    """ids with a batch dim, as the FLUX.2 pipelines pass them (what its `_cp_plan` splits)."""
    return {**kw, "img_ids": kw["img_ids"].unsqueeze(0), "txt_ids": kw["txt_ids"].unsqueeze(0)}


CP_INPUTS = {"flux2": _batched_ids}


def tp_peak(rank: int, world: int, family_name: str, variant: str, depth: dict, src_data_rank) -> dict:
    """This rank's resident high-water mark during `tensor_parallel` above what it held before (the kernel's VmHWM,
    reset just before the call), with the model's sizes for scale. malloc's mmap threshold is pinned, so that a
    freed tensor goes back to the system instead of staying in the heap (and counting) until reused."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    family = families()[family_name]
    config = published_config(family_name, variant, depth)
    mesh = init_device_mesh("cpu", (world,))
    model = surgery.unfuse(fast_seeded(family, config, seed=0))
    blocks = {}
    for name, p in model.named_parameters():
        head = ".".join(name.split(".")[:2]) if name.split(".")[0].endswith("blocks") else None
        if head is not None:
            blocks[head] = blocks.get(head, 0) + p.nbytes
    held = reset_peak()
    surgery.tensor_parallel(model, mesh, src_data_rank=src_data_rank)
    peak = status("VmHWM") - held
    sharded = sum(p.nbytes for p in model.parameters() if isinstance(p, DTensor) and p.placements[0].is_shard())
    return {"peak": peak, "model_bytes": sum(blocks.values()), "sharded_bytes": sharded,
            "largest_block": max(blocks.values()), "after": status("VmRSS") - held}
