"""`tensor_parallel`: shard an unfused model with stock `parallelize_module`, one call per transformer block.

Each module class that can be sharded has a plan of stock styles registered beside its definition (see
each family's file in `rewrites/`). Nothing here runs in forward: the plans' hooks and DTensor do all the work.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from .checks import SurgeryError, check_hooks, check_linear, check_model, mesh_sizes_dividing
from .registry import tp_plan_for, tp_plans
from .walk import block_path, find_modules, planned_modules


def per_head_norm(head_dim: int = 2) -> SequenceParallel:
    """The style for a norm applied to each rank's own heads (QK-norm on `[batch, seq, heads, head_dim]`).

    Its weight becomes a replicated DTensor and its input is declared sharded on the heads dim, so gradients of the
    weight are summed over ranks; no collective runs in forward.
    """
    return SequenceParallel(sequence_dim=head_dim, use_local_output=True)


def linear_placements(style: ParallelStyle) -> dict[str, tuple] | None:
    """How a stock linear style places a Linear's parameters (`None` for styles that place none)."""
    if isinstance(style, ColwiseParallel):
        return {"weight": (Shard(0),), "bias": (Shard(0),)}
    if isinstance(style, RowwiseParallel):
        return {"weight": (Shard(1),), "bias": (Replicate(),)}
    return None


def one_dim_mesh(mesh: DeviceMesh) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise SurgeryError(
            f"surgery.tensor_parallel: expected a torch DeviceMesh, got {type(mesh).__name__}. Build one with "
            "torch.distributed.device_mesh.init_device_mesh(device_type, (world_size,))."
        )
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names or ()
        hint = f"mesh['{names[-1]}']" if names else "a mesh built with mesh_dim_names, then mesh['tp']"
        raise SurgeryError(
            f"surgery.tensor_parallel: the mesh has {mesh.ndim} dimensions {tuple(mesh.shape)}; tensor parallelism "
            f"shards over one. Pass its tensor-parallel sub-mesh, e.g. {hint}."
        )
    return mesh


def validate(model: nn.Module, planned: list, world: int) -> None:
    """Every check `tensor_parallel` makes, before anything changes."""
    fused = find_modules(model, fused=True)
    if fused:
        path, module, _ = fused[0]
        raise SurgeryError(
            f"surgery.tensor_parallel: '{path}' is still a fused {type(module).__name__} ({len(fused)} fused "
            "module(s) in all); column sharding would cut across its concatenated projections. Call "
            "surgery.unfuse(model) first."
        )
    if not planned:
        known = sorted(getattr(cls, "__name__", str(cls).rpartition(".")[2]) for cls in tp_plans())
        raise SurgeryError(
            f"surgery.tensor_parallel: '{type(model).__name__}' holds no module with a tensor-parallel plan "
            f"(known: {', '.join(known)}). Register one with surgery.register_tp_plan."
        )
    check_model(model, "tensor_parallel")
    check_hooks(model, "<model>", "tensor_parallel", torch_hooks=False)
    for path, module, plan in planned:
        _, check = tp_plan_for(module)
        if check is not None:
            check(module, path, world)
        heads = getattr(module, "heads", None)
        if isinstance(heads, int) and heads % world:
            raise SurgeryError(
                f"surgery.tensor_parallel: '{path}' has {heads} attention heads, which a mesh of {world} cannot "
                f"split evenly. Use a mesh size that divides {heads}: {mesh_sizes_dividing(heads)}."
            )
        for key, style in plan.items():
            placements = linear_placements(style)
            if placements is None:
                continue
            linear_path = f"{path}.{key}" if path else key
            linear = module.get_submodule(key)
            check_linear(linear, linear_path, "tensor_parallel")
            check_hooks(linear, linear_path, "tensor_parallel", torch_hooks=False)
            dim = placements["weight"][0].dim
            size = linear.weight.shape[dim]
            if size % world:
                what = "output features" if dim == 0 else "input features"
                raise SurgeryError(
                    f"surgery.tensor_parallel: '{linear_path}' has {size} {what}, which a mesh of {world} cannot "
                    f"split evenly. Use a mesh size that divides {size}: {mesh_sizes_dividing(size)}."
                )


def block_plans(model: nn.Module, planned: list) -> list[tuple[str, dict[str, ParallelStyle], ParallelStyle | None]]:
    """`(block path, plan relative to the block, style for the block itself)`, each style a fresh copy."""
    blocks: dict[str, tuple[dict, list]] = {}
    for path, _, plan in planned:
        block, _ = block_path(model, path)
        relative = path[len(block) :].lstrip(".")
        entries, own = blocks.setdefault(block, ({}, []))
        for key, style in plan.items():
            full = ".".join(p for p in (relative, key) if p)
            if full:
                entries[full] = copy.copy(style)
            else:
                own.append(copy.copy(style))
    return [(block, entries, own[0] if own else None) for block, (entries, own) in blocks.items()]


def shard_on_host(module: nn.Module, plan: dict, mesh: DeviceMesh, src_data_rank: int | None) -> None:
    """Place the planned Linears' parameters that are not on the mesh's device as DTensors, moving only shards.

    torch's `distribute_tensor` would first move each whole weight to the device; here each rank slices its shard
    where the weight is and moves just that. The stock styles then find their parameters already placed.
    """
    for key, style in plan.items():
        placements = linear_placements(style)
        if placements is None:
            continue
        linear = module.get_submodule(key)
        for name, param in list(linear.named_parameters(recurse=False)):
            if isinstance(param, DTensor) or param.device.type == mesh.device_type or param.is_meta:
                continue
            tensor = place(param.detach(), placements[name][0], mesh, src_data_rank)
            setattr(linear, name, nn.Parameter(tensor, requires_grad=param.requires_grad))


def place(tensor: torch.Tensor, placement, mesh: DeviceMesh, src_data_rank: int | None) -> DTensor:
    """`tensor` (whole, on any device) as a DTensor on `mesh`, moving only this rank's shard to the mesh's device.

    `src_data_rank=None` keeps this rank's own values; a rank number sends that rank's values one shard at a time
    (a broadcast per shard: at most one shard besides this rank's own on the device at once).
    """
    pieces = tensor.chunk(mesh.size(), placement.dim) if isinstance(placement, Shard) else (tensor,)
    rank = mesh.get_local_rank() if len(pieces) > 1 else 0
    local = pieces[rank].to(mesh.device_type).contiguous()
    if src_data_rank is not None:
        group = mesh.get_group()
        src = dist.get_global_rank(group, src_data_rank)
        for i, piece in enumerate(pieces):
            mine = mesh.get_local_rank() == src_data_rank
            buffer = piece.to(mesh.device_type).contiguous() if mine else torch.empty_like(local)
            dist.broadcast(buffer, src=src, group=group)
            if i == rank:
                local = buffer
    return DTensor.from_local(local, mesh, (placement,), run_check=False)


def broadcast_replicated(model: nn.Module, mesh: DeviceMesh, src_data_rank: int) -> None:
    """Give every parameter and buffer held whole on each rank the values rank `src_data_rank` holds.

    Covers plain tensors and replicated DTensors alike (`SequenceParallel` replicates norm weights with `from_local`,
    which trusts every rank's copy).
    """
    group = mesh.get_group()
    src = dist.get_global_rank(group, src_data_rank)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if isinstance(tensor, DTensor):
                if not all(p.is_replicate() for p in tensor.placements):
                    continue
                tensor = tensor.to_local()
            if tensor.is_meta:
                continue
            data = tensor.detach()
            on_mesh = data if data.device.type == mesh.device_type else data.to(mesh.device_type)
            dist.broadcast(on_mesh, src=src, group=group)
            if on_mesh is not data:
                data.copy_(on_mesh)


def tensor_parallel(model: nn.Module, mesh: DeviceMesh, *, src_data_rank: int | None = 0) -> nn.Module:
    """Shard an unfused model over a 1-D `mesh` with stock `parallelize_module`; in place, returns `model`.

    Every check runs first; a raised `SurgeryError` leaves the model untouched. `src_data_rank` (a rank of `mesh`)
    is the rank whose weights every rank ends up with, as in `parallelize_module`; `None` lets each rank slice its
    own identical copy (loaded from one checkpoint) with no collective at all. Weights may sit on another device than
    the mesh (CPU weights, a cuda or neuron mesh): only shards are moved. Call `model.to(device)` afterwards to move
    the replicated rest.
    """
    mesh = one_dim_mesh(mesh)
    planned = planned_modules(model)
    validate(model, planned, mesh.size())
    apply_plans(model, planned, mesh, src_data_rank)
    if src_data_rank is not None:
        broadcast_replicated(model, mesh, src_data_rank)
    return model


def apply_plans(model: nn.Module, planned: list, mesh: DeviceMesh, src_data_rank: int | None) -> None:
    """One stock `parallelize_module` call per block (plus one for a block's own style); parameters already placed
    as DTensors, by `shard_on_host` or a sharded load, pass through the stock styles untouched."""
    for path, plan, own in block_plans(model, planned):
        block = model.get_submodule(path)
        shard_on_host(block, plan, mesh, src_data_rank)
        parallelize_module(block, mesh, plan, src_data_rank=src_data_rank)
        if own is not None:
            parallelize_module(block, mesh, own, src_data_rank=src_data_rank)
