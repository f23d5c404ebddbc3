"""What each gloo rank runs for the every-family published-width tier (`tests/families/test_family_width.py`).

One job of 4 ranks walks the families one after the other. Per family, rank 0 alone builds the widest published
config cut to one block of each kind (`one_block_each`) and computes the single-device fused references: the bf16
forward, then the fp32 forward and the gradients of a seeded projection of the output, written to a file every rank
maps. Then the unfused model is sharded with `surgery.tensor_parallel(src_data_rank=0)` on a 2-rank mesh (bf16
forward; fp32 forward and backward) and on the 4-rank mesh (fp32 forward and backward). Only rank 0 fills weights:
the other ranks build the model with uninitialised storage (`empty_model`), which the scatter from rank 0 overwrites
shard by shard, so a family costs one unsharded build per mesh, not one per rank. Gradients are compared shard by
shard against the reference's matching chunk (`distribute_tensor` with `src_data_rank=None`: a local slice).
"""

from __future__ import annotations

import gc
import inspect
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import surgery
from surgery.core.build import default_dtype, keep_in_fp32
from surgery.core.errors import SurgeryError
from surgery.core.registry import Family, families, model_class

from conformance_worker import conformant_families, floating_inputs, output
from published_width_worker import fast_seeded

DEPTH = re.compile(r"(num_|n_)?\w*(layers|blocks)|depth")


def one_block_each(family: Family, config: dict) -> dict:
    """`config` with one block of each kind: every integer `*layers` / `*blocks` argument (given or defaulted) is 1;
    a list with one entry per block (HiDream's `llama_layers`) keeps its first entries, a list of block indices
    (SD3.5's `dual_attention_layers`, VACE's `vace_layers`) those below 1."""
    defaults = {k: p.default for k, p in inspect.signature(model_class(family).__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    full = {**defaults, **config}
    counts = {k: v for k, v in full.items() if DEPTH.fullmatch(k) and type(v) is int and v > 1}
    out = dict(config, **{k: 1 for k in counts})
    blocks = sum(v for k, v in full.items() if DEPTH.fullmatch(k) and type(v) is int and k.startswith(("num_", "n_")))
    kept = sum(out[k] if k in out else full[k] for k in full
               if DEPTH.fullmatch(k) and type(full[k]) is int and k.startswith(("num_", "n_")))
    for key, value in full.items():
        if DEPTH.fullmatch(key) and isinstance(value, (list, tuple)) and all(type(i) is int for i in value):
            cut = value[:kept] if len(value) == blocks else [i for i in value if i < 1]
            out[key] = type(value)(cut)
    return out


CAP = 850_000_000  # parameters: the reference's fp32 weights and gradients (8 bytes each) stay within ~7 GB


def widest(family: Family) -> tuple[str, dict, int, int]:
    """The published variant whose one-block-each model holds the most parameters (counted on meta) within `CAP`:
    (variant, config, parameters, largest parameter's elements). Where none fits (FLUX.2-dev: 2.3 B), one kind of
    block is dropped (its count set to 0) from the widest variant that then fits."""
    candidates = []
    for variant in family.variants:
        config = one_block_each(family, family.config(variant))
        candidates.append((0, variant, config))
        kinds = [k for k, v in config.items() if DEPTH.fullmatch(k) and k.startswith(("num_", "n_")) and v == 1]
        for key in kinds if len(kinds) > 1 else []:  # never all of them: a model with no block proves nothing
            candidates.append((1, variant, dict(config, **{key: 0})))
    best = None
    for dropped, variant, config in candidates:
        try:  # not `model_on_meta`: it refuses a count of 0, which the model classes take
            with torch.device("meta"):
                model = model_class(family)(**config)
        except (TypeError, ValueError, ZeroDivisionError, RuntimeError, IndexError):
            continue
        count = sum(p.numel() for p in model.parameters())
        key = (dropped, -count)
        if count <= CAP and (best is None or key < best[0]):
            best = (key, variant, config, count, max(p.numel() for p in model.parameters()))
    return best[1:]


def empty_model(family: Family, config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """The model with uninitialised parameters (buffers computed as usual): what a rank holds that
    `tensor_parallel(src_data_rank=0)` fills from rank 0. Untouched pages cost no memory."""
    from accelerate import init_empty_weights

    with default_dtype(dtype), init_empty_weights():
        model = model_class(family)(**config)
    for name, param in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf,
                torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype), requires_grad=True))
    return keep_in_fp32(model).eval()


def build(rank: int, family: Family, config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """Rank 0: the seeded model (the same weights as the reference's); the others: storage rank 0's scatter fills."""
    return keep_in_fp32(fast_seeded(family, config, 0, dtype)) if rank == 0 else empty_model(family, config, dtype)


def projection(out: torch.Tensor) -> torch.Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)


def backward(model, kw: dict) -> tuple[torch.Tensor, dict]:
    """The output and the inputs' gradients of a seeded projection of it (parameters' gradients left in `.grad`)."""
    kw = {k: v.detach().clone().requires_grad_(True) if k in floating_inputs(kw) else v for k, v in kw.items()}
    out = output(model, kw)
    (out * projection(out)).sum().backward()
    return out.detach(), {k: kw[k].grad for k in floating_inputs(kw)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return surgery.testing.rel_err(a, b)


def grad_errors(model, reference: dict, mesh) -> dict[str, float]:
    """Per parameter of the sharded model: max |local gradient - the reference's matching chunk| over the largest
    reference gradient of its module (as `conformance_worker.gradient_errors`), on this rank's chunk."""
    scale: dict[str, float] = {}
    for name, g in reference.items():
        module = name.rpartition(".")[0]
        scale[module] = max(scale.get(module, 0.0), g.abs().max().item())
    errors = {}
    for name, p in model.named_parameters():
        ref, grad = reference.get(name), p.grad
        if ref is None or grad is None:  # unreached by the stock forward: unreached sharded too, else an error
            errors[name] = 0.0 if ref is None and grad is None else float("inf")
            continue
        if isinstance(grad, DTensor):
            if all(isinstance(pl, Shard) for pl in grad.placements):
                ref = distribute_tensor(ref, mesh, grad.placements, src_data_rank=None).to_local()
                grad = grad.to_local()
            else:
                grad = grad.full_tensor()
        diff = (grad.double() - ref.double()).abs().max().item()
        errors[name] = diff / max(scale[name.rpartition(".")[0]], 1e-30)
    return errors


TOKENS = ((4, 2), (16, 8))  # the fewest tokens first; the next where a model needs a grid of more


def bf16(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in bfloat16 (the modules diffusers keeps in float32 stay there), as a bf16 checkpoint loads."""
    return keep_in_fp32(model.to(torch.bfloat16))


def reference(family: Family, config: dict, path: Path) -> tuple[torch.nn.Module, dict]:
    """Rank 0: the single-device fused model's bf16 output (its weights the fp32 ones rounded), then its fp32 output,
    input and parameter gradients (the latter in the unfused layout), saved to `path`; returns the fp32 model (its
    gradients dropped) and its sizes."""
    info: dict = {}
    model = keep_in_fp32(fast_seeded(family, config, 0, torch.float32))
    info["parameters"] = sum(p.numel() for p in model.parameters())
    info["largest"] = max(p.numel() for p in model.parameters())
    info["largest_name"] = max(model.named_parameters(), key=lambda np: np[1].numel())[0]
    half = empty_model(family, config, torch.bfloat16)  # not a deep copy: that would hold a second fp32 model
    whole = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        for name, tensor in [*half.named_parameters(), *half.named_buffers()]:
            tensor.copy_(whole[name])
    del whole
    for image, text in TOKENS:
        kw = family.example_inputs(config, batch=1, image_tokens=image, text_tokens=text, seed=0, dtype=torch.bfloat16)
        try:
            with torch.no_grad():
                out_bf16 = output(half, kw)
        except (RuntimeError, ValueError, AssertionError, IndexError) as error:
            info.setdefault("token_errors", []).append(f"{image}/{text}: {str(error).splitlines()[0][:120]}")
            continue
        info["tokens"] = (image, text)
        break
    del half
    out, inputs = backward(model, inputs_at(family, config, info["tokens"], torch.float32))
    # a parameter the stock forward does not reach (JoyImage's last text stream) has no gradient, here or sharded
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    slices = [s for s in surgery.state_dict.weight_slices(model) if s.fused in grads]
    grads = surgery.state_dict.unfuse_state_dict(grads, slices) if slices else grads
    torch.save({"bf16": out_bf16, "out": out, "inputs": inputs,
                "grads": {k: v.contiguous() for k, v in grads.items()}}, path)
    del grads
    model.zero_grad(set_to_none=True)
    return model, info


def inputs_at(family: Family, config: dict, tokens: tuple, dtype: torch.dtype) -> dict:
    return family.example_inputs(config, batch=1, image_tokens=tokens[0], text_tokens=tokens[1], seed=0, dtype=dtype)


def sharded(model: torch.nn.Module, family: Family, config: dict, tokens, mesh, ref: dict, half: bool) -> dict:
    """The unfused `model` sharded over `mesh` (rank 0's weights) against the reference: fp32 forward, input and
    parameter gradients; with `half`, then the sharded model cast to bf16, its forward."""
    surgery.unfuse(model)
    try:
        surgery.tensor_parallel(model, mesh, src_data_rank=0)
    except SurgeryError as error:  # raised on every rank at once, before anything changed
        return {"refused": str(error)}
    out, inputs = backward(model, inputs_at(family, config, tokens, torch.float32))
    errors = grad_errors(model, ref["grads"], mesh)
    worst = max(errors, key=errors.get)
    result = {"forward": rel(out, ref["out"]), "grads": errors[worst], "worst": worst,
              "inputs": max((rel(inputs[k], g) for k, g in ref["inputs"].items()), default=0.0)}
    if half:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            result["bf16"] = rel(output(bf16(model), inputs_at(family, config, tokens, torch.bfloat16)), ref["bf16"])
    return result


def run(rank: int, world: int, names: list[str], root: str) -> dict:
    """Every family in `names`: the reference on rank 0, then world 4 (rank 0 shards the reference's own model) and
    world 2 (ranks 0 and 1; rank 0 builds the model again)."""
    assert world == 4
    pairs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "tp"))["tp"]  # ranks {0, 1} and {2, 3}
    mesh = init_device_mesh("cpu", (4,))
    results = {}
    for name in names:
        family = families()[name]
        variant, config, _, _ = widest(family)
        path = Path(root) / f"{name}.pt"
        clock = time.perf_counter()
        r: dict = {"variant": variant, "config": {k: v for k, v in config.items() if DEPTH.fullmatch(k)},
                   "seconds": {}}

        def lap(step: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            r["seconds"][step] = round(now - clock, 1)
            clock = now

        model, info = reference(family, config, path) if rank == 0 else (None, None)
        info = [info]
        dist.broadcast_object_list(info, src=0)
        r.update(info[0])
        lap("reference")
        ref = torch.load(path, mmap=True, weights_only=True)
        if rank:
            model = empty_model(family, config, torch.float32)
        r["w4"] = sharded(model, family, config, r["tokens"], mesh, ref, half=False)
        del model
        gc.collect()
        lap("world 4")
        if rank < 2:
            model = build(rank, family, config, torch.float32)
            r["w2"] = sharded(model, family, config, r["tokens"], pairs, ref, half=True)
            del model
        del ref
        gc.collect()
        dist.barrier()
        lap("world 2")
        if rank == 0:
            os.remove(path)
        results[name] = r
    return results


def names() -> list[str]:
    """Every family the conformance suite shards; `SURGERY_WIDTH_FAMILIES` (comma-separated names) picks some, to
    rerun one family or to split the tier between jobs."""
    chosen = os.environ.get("SURGERY_WIDTH_FAMILIES")
    every = [f.name for f in conformant_families()]
    if not chosen:
        return every
    unknown = sorted(set(chosen.split(",")) - set(every))
    if unknown:
        raise ValueError(f"SURGERY_WIDTH_FAMILIES names {unknown}; known: {every}")
    return [n for n in every if n in chosen.split(",")]
