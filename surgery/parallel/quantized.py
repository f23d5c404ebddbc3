"""Quantized weights under tensor parallelism: torchao tensors sharded the way torchao shards them itself.

torchao's `quantize_` run on a stock-sharded Linear (a DTensor weight) builds its quantized tensor around DTensors:
an `Int8Tensor` whose `qdata` is `Shard(0)` and whose per-row `scale` is `Shard(0)` too (colwise), or whose `qdata` is
`Shard(1)` while the per-row `scale` stays `Replicate()` (rowwise). Its own linear kernels then run on those DTensors,
and DTensor inserts exactly the collectives the unquantized plan has. `shard_quantized` builds that same tensor from a
weight quantized whole, cutting each inner tensor where this rank's part lies, so quantizing before or after
`tensor_parallel` ends in the same layout, and both equal the whole quantized model up to float noise.

An inner tensor is cut along the weight's cut dimension when it has one entry per block of that dimension; it stays
whole when it has one entry for the whole dimension (a per-row scale under a rowwise cut). A cut that does not fall on
a block boundary (per-group scales of 128 columns cut into 96-column shards) is refused with the module and numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from torch.distributed.tensor._ops._matrix_ops import mm_strategy
from torch.distributed.tensor._ops.utils import register_op_strategy

from surgery.core.errors import SurgeryError
from surgery.core.prequantized import gguf_weight, type_name


def torchao_tensor(tensor: torch.Tensor) -> bool:
    """A torchao quantized tensor (`Int8Tensor`, `Float8Tensor`, ...): a wrapper subclass that flattens to inner
    tensors."""
    cls = type(tensor)
    if cls is nn.Parameter:
        return False
    return cls.__module__.startswith("torchao") and hasattr(tensor, "__tensor_flatten__")


def quantized(tensor: torch.Tensor) -> bool:
    """A weight that the sharding here understands (see `check_split` for what it refuses): a torchao tensor or a
    GGUF weight (`surgery.core.prequantized.GGUFWeight`)."""
    return torchao_tensor(tensor) or gguf_weight(tensor)


def _inner(tensor: torch.Tensor) -> tuple[dict[str, torch.Tensor], object]:
    names, meta = tensor.__tensor_flatten__()
    return {name: getattr(tensor, name) for name in names}, meta


def _inner_placements(tensor: torch.Tensor, dim: int, world: int, path: str) -> dict[str, object]:
    """How each inner tensor of `tensor` is placed when the weight is cut along `dim` over `world` ranks; refuses a
    layout whose blocks a cut would split."""
    inner, _ = _inner(tensor)
    size = tensor.shape[dim]
    if gguf_weight(tensor):
        return _gguf_placements(tensor, dim, world, path)
    placements = {}
    for name, part in inner.items():
        if isinstance(part, DTensor):
            raise SurgeryError(
                f"surgery.tensor_parallel: '{path}' holds a {type(tensor).__name__} that is already sharded "
                f"({name} is a DTensor). Shard a model quantized whole, or quantize after surgery.tensor_parallel."
            )
        if part.ndim != tensor.ndim:
            raise SurgeryError(
                f"surgery.tensor_parallel: '{path}' holds a {type(tensor).__name__} whose {name} has shape "
                f"{tuple(part.shape)} for a weight of shape {tuple(tensor.shape)}: a packed layout that cannot be cut "
                "row- or column-wise. Quantize with a layout that keeps one entry per row or block (torchao "
                "Int8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, Float8WeightOnlyConfig), or quantize "
                "after surgery.tensor_parallel."
            )
        if part.shape[dim] == 1 and size > 1:
            placements[name] = Replicate()
            continue
        if size % part.shape[dim]:
            raise SurgeryError(
                f"surgery.tensor_parallel: '{path}' holds a {type(tensor).__name__} whose {name} has "
                f"{part.shape[dim]} entries along dimension {dim} of size {size}: not whole blocks."
            )
        block = size // part.shape[dim]
        if (size // world) % block:
            raise SurgeryError(
                f"surgery.tensor_parallel: '{path}' is quantized in blocks of {block} along dimension {dim} ({name} "
                f"{tuple(part.shape)}); a mesh of {world} cuts its {size} {'rows' if dim == 0 else 'columns'} into "
                f"shards of {size // world}, inside a block. Use a mesh size whose shard is a multiple of {block}, "
                f"or a smaller block (group_size) when quantizing."
            )
        placements[name] = Shard(dim)
    return placements


def _gguf_placements(tensor: torch.Tensor, dim: int, world: int, path: str) -> dict[str, object]:
    """A GGUF weight's bytes are cut like the weight: whole byte rows (colwise), or each row's bytes at a block
    boundary (rowwise), refused where this rank's columns would end inside a block."""
    if isinstance(tensor.qdata, DTensor):
        raise SurgeryError(
            f"surgery.tensor_parallel: '{path}' holds a GGUF weight that is already sharded (its bytes are a DTensor). "
            "Shard a model loaded whole."
        )
    size = tensor.shape[dim]
    if dim == 1 and (size // world) % tensor.block:
        raise SurgeryError(
            f"surgery.tensor_parallel: '{path}' is GGUF {type_name(tensor.ggml_type)}, quantized in blocks of "
            f"{tensor.block} input columns; a mesh of {world} cuts its {size} columns into shards of {size // world}, "
            f"inside a block. Use a mesh size whose shard is a multiple of {tensor.block} (here: "
            f"{[n for n in range(1, world + 1) if size % n == 0 and (size // n) % tensor.block == 0]}), or a checkpoint "
            "with smaller blocks (Q8_0 / Q4_0: 32 columns)."
        )
    return {"qdata": Shard(dim)}


def check_split(tensor: torch.Tensor, dim: int, world: int, path: str) -> None:
    """Refuses, with the module and the numbers, a quantized weight that cannot be cut along `dim` over `world`."""
    if not quantized(tensor):
        raise SurgeryError(
            f"surgery.tensor_parallel: '{path}' holds a {type(tensor).__module__}.{type(tensor).__name__}, a "
            "quantized layout surgery cannot cut. Quantize with torchao (Int8WeightOnlyConfig, "
            "Int8DynamicActivationInt8WeightConfig, Float8WeightOnlyConfig) after surgery.unfuse."
        )
    if tensor.shape[dim] % world:
        raise SurgeryError(
            f"surgery.tensor_parallel: '{path}' has {tensor.shape[dim]} {'output' if dim == 0 else 'input'} "
            f"features, which a mesh of {world} cannot split evenly."
        )
    _inner_placements(tensor, dim, world, path)


def shard_quantized(tensor: torch.Tensor, placement, mesh: DeviceMesh, src_data_rank: int | None,
                    path: str, place) -> torch.Tensor:
    """The torchao tensor `tensor` (quantized whole) as torchao's own sharded layout on `mesh`: the same class around
    DTensor inner tensors, each this rank's cut (or whole) and moved to the mesh's device; an integer `src_data_rank`
    gives every rank that rank's values (a broadcast per inner shard). `place(tensor, placement, mesh, src_data_rank)`
    moves one plain tensor's shard: the unquantized path's own mover, for each inner tensor."""

    enable_quantized_ops()
    inner, meta = _inner(tensor)
    placements = (_inner_placements(tensor, placement.dim, mesh.size(), path)
                  if isinstance(placement, Shard) else {name: Replicate() for name in inner})
    sharded = {name: place(part, placements[name], mesh, src_data_rank) for name, part in inner.items()}
    return type(tensor).__tensor_unflatten__(sharded, meta, tensor.shape, tensor.stride())


def mesh_of(tensor: torch.Tensor):
    """The mesh a (possibly quantized) weight is sharded over: a DTensor's, or that of a torchao tensor's DTensor inner
    tensors; None for a whole weight."""
    if isinstance(tensor, DTensor):
        return tensor.device_mesh
    if quantized(tensor):
        return next((p.device_mesh for p in _inner(tensor)[0].values() if isinstance(p, DTensor)), None)
    return None


def local_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors this rank holds for `tensor`: its local shard, or a quantized tensor's inner tensors' shards."""
    if isinstance(tensor, DTensor):
        return local_parts(tensor.to_local())
    if quantized(tensor):
        return [part for inner in _inner(tensor)[0].values() if inner is not None for part in local_parts(inner)]
    return [tensor]


def held_bytes(model: nn.Module) -> int:
    """Parameter and buffer bytes this rank holds, counting a quantized weight by what it stores (int8 values and
    scales), not by the float dtype it presents."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(part.nbytes for t in tensors for part in local_parts(t))


def broadcast_quantized(tensor: torch.Tensor, mesh: DeviceMesh, src_data_rank: int) -> None:
    """Give a quantized weight held whole on each rank the values rank `src_data_rank` holds (inner tensors that are
    DTensors came from that rank when they were placed)."""
    group = mesh.get_group()
    src = dist.get_global_rank(group, src_data_rank)
    for part in _inner(tensor)[0].values():
        if isinstance(part, DTensor):
            if not all(p.is_replicate() for p in part.placements):
                continue
            part = part.to_local()
        if part is None or part.is_meta:
            continue
        if part.dtype.itemsize == 1 and part.is_floating_point():  # gloo sends no float8: send its bytes
            part = part.view(torch.uint8)
        on_mesh = part if part.device.type == mesh.device_type else part.to(mesh.device_type)
        dist.broadcast(on_mesh, src=src, group=group)
        if on_mesh is not part:
            part.copy_(on_mesh)


def release(tensor: torch.Tensor) -> None:
    """Free what a quantized weight replaced by its shards stores (its inner tensors), keeping the object."""
    for name, part in _inner(tensor)[0].items():
        if part is not None:
            setattr(tensor, name, torch.empty(0, dtype=part.dtype, device=part.device))


def refill(original: torch.Tensor, current: torch.Tensor) -> None:
    """Give a released quantized weight back the whole inner tensors of the sharded one that replaced it (an
    all-gather per sharded inner tensor, in the same order on every rank)."""
    for name, part in _inner(current)[0].items():
        if part is not None:
            whole = part.full_tensor() if isinstance(part, DTensor) else part
            setattr(original, name, whole.detach().to(getattr(original, name).device).clone())


def inner_pairs(current: torch.Tensor, original: torch.Tensor) -> list[tuple[DTensor, torch.Tensor]]:
    """(sharded inner DTensor, the whole inner tensor it was cut from) for each sharded inner tensor."""
    now, before = _inner(current)[0], _inner(original)[0]
    return [(part, before[name]) for name, part in now.items()
            if isinstance(part, DTensor) and part.placements[0].is_shard()]


_ENABLED = False


def enable_quantized_ops() -> None:
    """Teach DTensor the one op torchao's int8 dynamic-activation kernel adds: `aten._int_mm` (int8 x int8 -> int32)
    shards exactly like `aten.mm`, so a rowwise cut sums exact int32 partials across ranks."""
    global _ENABLED
    if _ENABLED:
        return
    register_op_strategy(torch.ops.aten._int_mm.default)(mm_strategy)
    _ENABLED = True
