"""GEMMs, cats and collectives per forward, whole and on each gloo rank: the fused model, its unfused form, surgery's
TP and diffusers' packed TP (`enable_parallelism`'s `apply_tensor_parallel`), each from the same seeded weights."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import surgery
from surgery.core.registry import families, model_class
from surgery.core.split_projection import SplitProjection
from surgery.state_dict import weight_slices
from surgery.testing import CollectiveCounter, diffusers_packed_tp, rel_err, seeded_model

# The configs counted: FLUX.2 with 2 double + 3 single blocks (the issue's), FLUX.1 and FLUX.3 at their TP configs.
CASES = {
    "flux2": ("tp_wide", {"num_single_layers": 3}),
    "flux1": ("tp_dev", {}),
    "flux3": ("tp_wide", {}),
}


def make(family_name: str, seed: int = 0):
    family = families()[family_name]
    name, override = CASES[family_name]
    config = {**family.tests.configs[name], **override}
    return family, config, seeded_model(family, config, seed, torch.float32)


def inputs(family, config: dict, seed: int = 0) -> dict:
    return family.example_inputs(config, batch=1, image_tokens=16, text_tokens=8, seed=seed, dtype=torch.float32)


def counted(model, kw: dict, warm: bool = True) -> tuple[dict, torch.Tensor]:
    """The work of one forward, after one uncounted forward (`warm`): the first forward run for inference lays each
    SplitProjection's columns out in one buffer (one `cat` each), once."""
    with torch.no_grad():
        if warm:
            model(**kw, return_dict=False)
        with CollectiveCounter() as counter:
            out = model(**kw, return_dict=False)[0]
    return counter.work(), out


def whole(family_name: str, seed: int = 0) -> dict:
    """Counts (and the unfused output's error) of the fused and unfused model on one process."""
    family, config, fused = make(family_name, seed)
    kw = inputs(family, config, seed)
    result = {}
    result["fused"], expected = counted(fused, kw)
    unfused = surgery.unfuse(copy.deepcopy(fused))
    result["unfused"], out = counted(unfused, kw)
    result["unfused_error"] = rel_err(out, expected)
    result["split_projections"] = split_projections(unfused)
    return result


def per_rank(rank: int, world: int, family_name: str, seed: int = 0) -> dict:
    """Counts on this rank of surgery's TP and diffusers' packed TP (where diffusers ships a `_tp_plan`)."""
    family, config, fused = make(family_name, seed)
    kw = inputs(family, config, seed)
    mesh = init_device_mesh("cpu", (world,))
    with torch.no_grad():
        expected = fused(**kw, return_dict=False)[0]
    result = {}
    model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), mesh)
    result["surgery_tp"], out = counted(model, kw)
    result["surgery_tp_error"] = rel_err(out, expected)
    if getattr(model_class(family), "_tp_plan", None) is not None:
        packed = diffusers_packed_tp(copy.deepcopy(fused), mesh)
        result["packed_tp"], out = counted(packed, kw)
        result["packed_tp_error"] = rel_err(out, expected)
    return result


def split_projections(model) -> int:
    """How many `SplitProjection` leaves `model` holds."""
    return sum(isinstance(m, SplitProjection) for m in model.modules())


def all_per_rank(rank: int, world: int, seed: int = 0) -> dict:
    return {**{name: per_rank(rank, world, name, seed) for name in CASES},
            "flux3_conventions": conventions(rank, world, "flux3", seed)}


def conventions(rank: int, world: int, family_name: str = "flux3", seed: int = 0) -> dict:
    """Surgery's TP of `family_name` on this rank, its blocks called as diffusers calls them at inference (its joint
    single blocks by keyword, autograd off) and under gradient checkpointing (positionally, autograd on): all-reduces
    and their bytes per forward, how the first single block was called, the output's error against the fused model
    whole and, checkpointed, every parameter gradient's."""
    family, config, fused = make(family_name, seed)
    kw = inputs(family, config, seed)
    mesh = init_device_mesh("cpu", (world,))
    model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), mesh)
    calls = []
    model.single_transformer_blocks[0].register_forward_pre_hook(
        lambda m, args, kwargs: calls.append("positional" if args else "keyword"), with_kwargs=True)
    result = {}
    with torch.no_grad():
        expected = fused(**kw, return_dict=False)[0]
        with CollectiveCounter() as counter:
            out = model(**kw, return_dict=False)[0]
    result["keyword"] = {"all_reduces": counter.total, "bytes": counter.bytes, "error": rel_err(out, expected),
                         "calls": sorted(set(calls))}
    calls.clear()
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed + 1))
    grads = []
    for m in (fused, model):
        m.enable_gradient_checkpointing()
        with CollectiveCounter() as counter:
            out = m(**kw, return_dict=False)[0]
        (out * weights).sum().backward()
        grads.append({n: full(p.grad) for n, p in m.named_parameters() if p.grad is not None})
    slices = {s.unfused: s for s in weight_slices(fused)}
    result["positional"] = {
        "all_reduces": counter.total, "bytes": counter.bytes, "error": rel_err(out.detach(), expected),
        "calls": sorted(set(calls)), "grads": len(grads[1]), "parameters": len(list(model.parameters())),
        "grad_error": max(rel_err(g, fused_part(grads[0], slices, name)) for name, g in grads[1].items()),
    }
    return result


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def fused_part(grads: dict, slices: dict, name: str) -> torch.Tensor:
    """The fused model's gradient of unfused parameter `name` (its slice of the fused gradient, where it is one)."""
    s = slices.get(name)
    return grads[name] if s is None else grads[s.fused].narrow(s.dim, s.start, s.size)
