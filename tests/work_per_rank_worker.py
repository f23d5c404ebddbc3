"""GEMMs, cats and collectives per forward, whole and on each gloo rank: the fused model, its unfused form, surgery's
TP and diffusers' packed TP (`enable_parallelism`'s `apply_tensor_parallel`), each from the same seeded weights."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

import surgery
from surgery.core.registry import families, model_class
from surgery.core.split_projection import SplitProjection
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
    config = {**family.test_configs[name], **override}
    return family, config, seeded_model(family, config, seed, torch.float32)


def inputs(family, config: dict, seed: int = 0) -> dict:
    return family.example_inputs(config, batch=1, image_tokens=16, text_tokens=8, seed=seed, dtype=torch.float32)


def counted(model, kw: dict) -> tuple[dict, torch.Tensor]:
    with torch.no_grad(), CollectiveCounter() as counter:
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
    """How many `SplitProjection` leaves `model` holds: each runs its two column parts (2 GEMMs where the fused
    Linear runs 1; see surgery.core.split_projection)."""
    return sum(isinstance(m, SplitProjection) for m in model.modules())


def all_per_rank(rank: int, world: int, seed: int = 0) -> dict:
    return {name: per_rank(rank, world, name, seed) for name in CASES}
