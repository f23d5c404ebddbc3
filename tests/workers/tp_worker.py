"""What each gloo rank runs for the tensor-parallel tests; results come back to pytest as plain data."""

from __future__ import annotations

import copy
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import surgery
from surgery.testing import CollectiveCounter, diffusers_packed_tp
from surgery.sight.report import local_bytes
from flux2_testing import assert_unchanged, build, inputs, rel_err, small_config, snapshot, use_kv_processors

# (config, seed, batch, guidance on)
CASES = {
    2: [("klein9b_small", 0, 2, True), ("dev_small", 1, 2, True), ("dev_small", 2, 1, False), ("tp_wide", 3, 3, True)],
    4: [("klein9b_small", 0, 2, True), ("tp_wide", 1, 2, True), ("tp_wide", 2, 1, False)],
}


def _forward(model, kw):
    return model(**kw, return_dict=False)[0]


def _case_inputs(config, seed, batch, guidance):
    kw = inputs(config, seed, batch=batch)
    if not guidance:
        kw["guidance"] = None
    return kw


def sharded(model, mesh, src_data_rank=0):
    return surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(model)), mesh, src_data_rank=src_data_rank)


def check_case(rank, world, mesh, name, seed, batch, guidance) -> dict:
    config = small_config(name)
    fused = build(config, seed)
    kw = _case_inputs(config, seed, batch, guidance)
    result = {}
    with torch.no_grad():
        expected = _forward(fused, kw)
        model = sharded(fused, mesh)
        with CollectiveCounter() as ours:
            result["forward"] = rel_err(_forward(model, kw), expected)
        packed = diffusers_packed_tp(copy.deepcopy(fused), mesh)
        with CollectiveCounter() as theirs:
            result["diffusers_forward"] = rel_err(_forward(packed, kw), expected)
    result["collectives"], result["diffusers_collectives"] = dict(ours.counts), dict(theirs.counts)
    result["allreduce_bytes"], result["diffusers_allreduce_bytes"] = ours.bytes, theirs.bytes

    unfused = surgery.unfuse(copy.deepcopy(fused))
    # the plan's intent for FLUX.2, written here rather than read back from the sharded model: every Linear of both
    # block stacks is cut (colwise or rowwise; FLUX.2's have no bias), everything else is whole
    intended = {f"{n}.{p}" for n, m in unfused.named_modules() if isinstance(m, nn.Linear) and "transformer_blocks." in n
                for p, _ in m.named_parameters(recurse=False)}
    actual = {n for n, p in model.named_parameters() if isinstance(p, DTensor) and p.placements[0].is_shard()}
    result["sharded_not_as_intended"] = sorted(intended ^ actual)
    sharded_bytes = sum(p.nbytes for n, p in unfused.named_parameters() if n in intended)
    result["bytes"] = local_bytes(model)
    result["expected_bytes"] = local_bytes(unfused) - sharded_bytes + sharded_bytes // world
    result["diffusers_bytes"] = local_bytes(packed)
    result["backward"] = check_backward(model, unfused, config, seed, batch, guidance)
    return result


def check_backward(model, unfused, config, seed, batch, guidance) -> dict:
    """Gradients of inputs and of every parameter (sharded ones gathered) against the single-device unfused model."""
    grads = []
    for m in (unfused, model):
        kw = _case_inputs(config, seed, batch, guidance)
        kw["hidden_states"].requires_grad_(True)
        out = _forward(m, kw)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))).sum().backward()
        params = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in m.named_parameters()}
        grads.append((kw["hidden_states"].grad, params))
    (ref_input, ref), (input_grad, tp) = grads
    assert [n for n, g in tp.items() if g is None] == [n for n, g in ref.items() if g is None]  # unused embedders
    return {"input": rel_err(input_grad, ref_input),
            "params": max(rel_err(tp[n], g) for n, g in ref.items() if g is not None),
            "sharded_params": sum(isinstance(p.grad, DTensor) for p in model.parameters())}


def check_kv_cache(mesh, name) -> dict:
    config = small_config(name)
    fused = build(config, 7)
    model = sharded(fused, mesh)
    use_kv_processors(fused)
    use_kv_processors(model)
    extract = inputs(config, 7, image_tokens=14)
    cached = inputs(config, 17)
    errors = {}
    with torch.no_grad():
        runs = []
        for m in (fused, model):
            out, cache = m(**extract, kv_cache_mode="extract", num_ref_tokens=4, return_dict=False)
            runs.append((out, _forward(m, dict(cached, kv_cache=cache, kv_cache_mode="cached"))))
    errors["extract"] = rel_err(runs[1][0], runs[0][0])
    errors["cached"] = rel_err(runs[1][1], runs[0][1])
    return errors


def check_src_data_rank(rank, mesh) -> dict:
    """`None`: no collective while sharding. Default: ranks built with different seeds all end up with rank 0's."""
    config = small_config("tp_wide")
    kw = inputs(config, 5)
    result = {}
    with torch.no_grad():
        expected = _forward(build(config, 5), kw)
        model = surgery.unfuse(build(config, 5))
        with CollectiveCounter() as counter:
            surgery.tensor_parallel(model, mesh, src_data_rank=None)
        result["none_sharding_collectives"] = (dict(counter.counts), counter.bytes)
        result["none_forward"] = rel_err(_forward(model, kw), expected)

        model = surgery.unfuse(build(config, 5 + 100 * rank))  # rank 0's weights are the seed-5 ones
        surgery.tensor_parallel(model, mesh)
        result["rank0_forward"] = rel_err(_forward(model, kw), expected)
    return result


def check_place(rank, mesh) -> dict:
    """The host-side placement used when weights sit on another device than the mesh, run here on CPU."""
    from torch.distributed.tensor import Replicate, Shard

    from surgery.parallel.quantized import place

    mine = torch.randn(8, 12, generator=torch.Generator().manual_seed(rank))
    rank0 = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    out = {}
    for placement in (Shard(0), Shard(1), Replicate()):
        with CollectiveCounter() as counter:
            own = place(mine, placement, mesh, None)
        out[f"{placement}-none"] = (torch.equal(own.to_local(), _expected_local(mine, placement, mesh)), counter.total)
        from_rank0 = place(mine, placement, mesh, 0)
        out[f"{placement}-0"] = (torch.equal(from_rank0.full_tensor(), rank0), from_rank0.placements == (placement,))
    return out


def _expected_local(tensor, placement, mesh):
    return tensor.chunk(mesh.size(), placement.dim)[mesh.get_local_rank()] if placement.is_shard() else tensor


def check_enable_parallelism_plan(rank, world, mesh) -> dict:
    """diffusers' `apply_tensor_parallel` with the instance `_tp_plan` that `unfuse` set: correct, plain styles."""
    config = small_config("klein9b_small")
    fused = build(config, 9)
    kw = inputs(config, 9)
    with torch.no_grad():
        model = diffusers_packed_tp(surgery.unfuse(copy.deepcopy(fused)), mesh)
        with CollectiveCounter() as counter:
            error = rel_err(_forward(model, kw), _forward(fused, kw))
    return {"forward": error, "collectives": dict(counter.counts)}


def refusal(fn, model) -> dict:
    snap = snapshot(model)
    try:
        fn(model)
    except surgery.SurgeryError as error:
        assert_unchanged(model, snap)
        return {"error": str(error)}
    return {"error": None}


def check_refusals(rank, world, mesh) -> dict:
    shard = lambda m: surgery.tensor_parallel(m, mesh)  # noqa: E731
    out = {"fused": refusal(shard, build(small_config("tp_wide")))}
    odd = small_config("odd_heads")
    out["heads"] = refusal(shard, surgery.unfuse(build(odd)))
    uneven = dict(small_config("klein9b_small"), mlp_ratio=2.53)  # int(64 * 2.53) = 161 hidden units
    out["mlp_hidden"] = refusal(shard, surgery.unfuse(build(uneven)))
    twice = sharded(build(small_config("tp_wide")), mesh)
    out["twice"] = refusal(shard, twice)

    from peft import LoraConfig

    lora = surgery.unfuse(build(small_config("tp_wide")))
    lora.add_adapter(LoraConfig(r=2, target_modules=["to_q"]))
    out["peft"] = refusal(shard, lora)
    if world == 4:
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        out["mesh_2d"] = refusal(lambda m: surgery.tensor_parallel(m, grid), surgery.unfuse(build(small_config("tp_wide"))))
        config = small_config("tp_wide")
        kw = inputs(config, 4)
        with torch.no_grad():
            model = surgery.tensor_parallel(surgery.unfuse(build(config, 4)), grid["tp"])
            out["sub_mesh_forward"] = rel_err(_forward(model, kw), _forward(build(config, 4), kw))
    return out


def run(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    return {
        "cases": {f"{c[0]}-{c[1]}": check_case(rank, world, mesh, *c) for c in CASES[world]},
        "kv": check_kv_cache(mesh, "tp_wide"),
        "src_data_rank": check_src_data_rank(rank, mesh),
        "enable_parallelism": check_enable_parallelism_plan(rank, world, mesh),
        "place": check_place(rank, mesh),
        "refusals": check_refusals(rank, world, mesh),
    }
