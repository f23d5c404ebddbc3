"""The conformance checks every registered family gets, as plain functions: single-device ones run in pytest, the
tensor-parallel ones on each gloo rank of one spawned job per world size."""

from __future__ import annotations

import copy
import os
import zlib

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import surgery
from surgery.sight.report import local, local_bytes
from surgery.core.registry import Family, families, model_class
from surgery.testing import (BF16_TOL, FP32_GRAD_TOL, FP32_TOL, CollectiveCounter,  # noqa: F401 - the tests read them here
                             diffusers_packed_tp, flex_as, rel_err, sample, seeded_model)



def grad_tolerance(family: Family) -> float:
    """The bound on sharded-vs-whole gradients: float32's, or bfloat16's where the stock forward itself rounds to
    bfloat16 in float32 (`Tests.rounds_to`), whose backward rounds the gradients there too."""
    return BF16_TOL if family.tests.rounds_to == torch.bfloat16 else FP32_GRAD_TOL


def conformant_families() -> list[Family]:
    """Families with a model to build: published variants and small test configs. A family with variants and no test
    configs is not silently left out of the proof: `test_conformance.EveryFamily` fails on it. `SURGERY_FAMILIES`
    (names, comma-separated) runs the suite on those alone, while working on them."""
    return [f for f in families().values() if f.variants and f.tests.configs and chosen(f.name)]


def chosen(family_name: str) -> bool:
    """Whether `SURGERY_FAMILIES` (names, comma-separated; unset: every family) selects the family."""
    names = [name for name in os.environ.get("SURGERY_FAMILIES", "").split(",") if name]
    return not names or family_name in names


def family_cases(tp_only: bool = False) -> list[tuple[str, str]]:
    """`(family, test config)` for every family; `tp_only`: the first test config of each (what runs sharded)."""
    cases = []
    for family in conformant_families():
        names = list(family.tests.configs)
        cases += [(family.name, name) for name in (names[:1] if tp_only else names)]
    return cases


def make(family_name: str, config_name: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    family = families()[family_name]
    config = dict(family.tests.configs[config_name])
    return family, config, seeded_model(family, config, seed, dtype)


def inputs(family: Family, config: dict, seed: int, dtype: torch.dtype = torch.float32, batch: int = 2) -> dict:
    return family.example_inputs(config, batch=batch, image_tokens=16, text_tokens=8, seed=seed, dtype=dtype)


def output(model: nn.Module, kw: dict) -> torch.Tensor:
    return sample(model, **kw)


def floating_inputs(kw: dict) -> list[str]:
    return [k for k, v in kw.items() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 2]


def gradients(model: nn.Module, kw: dict, seed: int) -> tuple[dict, dict]:
    """Input and parameter gradients of a seeded random projection of the output."""
    kw = {k: v.detach().clone().requires_grad_(True) if k in floating_inputs(kw) else v for k, v in kw.items()}
    out = output(model, kw)
    # drawn in float32 whatever the output's dtype, so that a float64 run is projected on the same vector
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)).sum().backward()
    params = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
              for n, p in model.named_parameters() if p.grad is not None}
    return {k: kw[k].grad for k in floating_inputs(kw)}, params


def gradient_errors(got: dict, ref: dict) -> dict[str, float]:
    """Per parameter: max |got - ref| over the largest reference gradient of its module (its own for a weight; the
    weight's for a bias). A mathematically vanishing gradient (a key bias without QK-norm: softmax ignores it) is
    rounding noise, so it is compared on the scale of its projection's gradients, not on its own."""
    scale: dict[str, float] = {}
    for n, g in ref.items():
        module = n.rpartition(".")[0]
        scale[module] = max(scale.get(module, 0.0), g.abs().max().item())
    return {n: ((got[n].double() - g.double()).abs().max() / max(scale[n.rpartition(".")[0]], 1e-30)).item()
            for n, g in ref.items()}


def tp_case(rank: int, world: int, family_name: str, config_name: str, seed: int) -> dict:
    """Sharded unfused model vs the single-device fused one: forward, gathered gradients, collectives, bytes. A family
    whose attention runs `flex` (`Tests.flex_backward`) is compared twice: with the stock kernel, then, counted and
    differentiated, with the kernel it names (flex attention has no backward on CPU)."""
    family, config, fused = make(family_name, config_name, seed)
    mesh = init_device_mesh("cpu", (world,))
    kw = inputs(family, config, seed)
    result = {}
    with torch.no_grad():
        expected = output(fused, kw)
        model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), mesh)
        if family.tests.flex_backward:
            # the stock flex kernel, outside the counter (under a dispatch mode flex attention insists on compiling);
            # then the kernel the gradients are checked with, whole and sharded, counted
            result["flex_forward"] = rel_err(output(model, kw), expected)
            with flex_as(family.tests.flex_backward):
                expected = output(fused, kw)
        with flex_as(family.tests.flex_backward), CollectiveCounter() as ours:
            result["forward"] = max(result.get("flex_forward", 0.0), rel_err(output(model, kw), expected))
        result["collectives"] = dict(ours.counts)
        if getattr(model_class(family), "_tp_plan", None) is not None:
            packed = diffusers_packed_tp(copy.deepcopy(fused), mesh)
            with CollectiveCounter() as theirs:
                result["diffusers_forward"] = rel_err(output(packed, kw), expected)
            result["diffusers_collectives"] = dict(theirs.counts)
    result["expected_all_reduces"] = family.tp.all_reduces(config) if family.tp.all_reduces else None

    unfused = surgery.unfuse(copy.deepcopy(fused))
    sharded = {n for n, p in model.named_parameters() if isinstance(p, DTensor) and p.placements[0].is_shard()}
    sharded_bytes = sum(p.nbytes for n, p in unfused.named_parameters() if n in sharded)
    result["bytes"] = local_bytes(model)
    result["expected_bytes"] = local_bytes(unfused) - sharded_bytes + sharded_bytes // world
    result["sharded_params"] = len(sharded)

    with flex_as(family.tests.flex_backward):
        (ref_in, ref), (tp_in, tp) = gradients(fused, kw, seed), gradients(model, kw, seed)
    tp = surgery.state_dict.fuse_state_dict(tp, surgery.state_dict.weight_slices(model)) if surgery.state_dict.weight_slices(model) else tp
    result["grad_keys_match"] = sorted(tp) == sorted(ref)
    result["param_grads"] = max(gradient_errors(tp, ref).values())
    result["input_grads"] = max((rel_err(tp_in[k], g) for k, g in ref_in.items()), default=0.0)
    if max(result["param_grads"], result["input_grads"]) > grad_tolerance(family):
        with flex_as(family.tests.flex_backward):
            result["float64"] = float64_errors(fused, kw, seed, stock=(ref_in, ref), sharded=(tp_in, tp))
    return result


# Where a gradient is past the bound, the sharded one may be this many times as far from float64 as the stock float32
# one is: two float32 runs of an ill-conditioned gradient in different orders carry independent rounding of the same
# size, whose max over a weight varies by tens of percent from order to order (LongCat-AudioDiT's q_norm at world 4:
# sharded 2.2e-5 from float64, stock 3.8e-5; Wan-Animate's published-width cross-attention norm_k at world 2: sharded
# 3.15e-5, stock 2.95e-5). A wrong cut is far beyond it: the sharded q_norm gradients scaled by 1 + 3e-4 are 2.98e-4
# from float64, 7.8 times stock.
ROUNDING_SPREAD = 2.0


def float64_errors(fused: nn.Module, kw: dict, seed: int, **gradients_by_run: tuple[dict, dict]) -> dict[str, float]:
    """How far each run's (input, parameter) gradients are from the single-device model's in float64. An
    ill-conditioned gradient carries more of float32's rounding than the bound in the stock model itself
    (LongCat-AudioDiT's self-attention `q_norm` weight: 3.8e-5 from float64; the sharded one at world 4 is 5.9e-5 from
    stock and 2.2e-5 from float64): there, the sharded model is held to `ROUNDING_SPREAD` times stock's distance."""
    kw64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()}
    inputs64, params64 = gradients(copy.deepcopy(fused).double(), kw64, seed)
    return {run: max([*gradient_errors(params, params64).values(),
                      *(rel_err(ins[k].double(), g) for k, g in inputs64.items())])
            for run, (ins, params) in gradients_by_run.items()}


def tp_load_case(rank: int, world: int, family_name: str, config_name: str, seed: int, folder: str) -> dict:
    """`load_tensor_parallel` of a fused checkpoint equals `unfuse` + `tensor_parallel` of the model, bitwise."""
    family, config, fused = make(family_name, config_name, seed)
    mesh = init_device_mesh("cpu", (world,))
    loaded = surgery.load_tensor_parallel(model_class(family), folder, mesh, progress=False)
    reference = surgery.tensor_parallel(surgery.unfuse(fused), mesh, src_data_rank=None)
    mismatched = [
        n for n, p in reference.named_parameters()
        if type(p) is not type(loaded.get_parameter(n))
        or (isinstance(p, DTensor) and p.placements != loaded.get_parameter(n).placements)
        or not torch.equal(local(p), local(loaded.get_parameter(n)))
    ]
    return {"mismatched": mismatched}


def case_seed(family_name: str, config_name: str) -> int:
    """The seed of a sharded case, read off its name: the same on every rank, and unchanged when families are added
    (a seed by position would redraw every later case's weights)."""
    return zlib.crc32(f"{family_name}/{config_name}".encode()) % 10_000


def run(rank: int, world: int, cases: list[tuple[str, str]], checkpoints: dict) -> dict:
    out = {}
    for family_name, config_name in cases:
        key = f"{family_name}/{config_name}"
        out[key] = tp_case(rank, world, family_name, config_name, case_seed(family_name, config_name))
        if key in checkpoints:
            out[key]["load"] = tp_load_case(rank, world, family_name, config_name, *checkpoints[key])
    return out
