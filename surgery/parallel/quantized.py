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

This module is the one seam between sharding and quantization: `tensor_parallel` adopts a pre-quantized model's
Linears (`adopt`), places each planned parameter with `place_parameter`, and moves, frees and refills every
parameter through `parts` (a plain tensor's parts: itself), so the sharding code takes no branch on quantization.
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
from surgery.core.prequantized import adopt_prequantized, gguf_weight, restore_adopted, type_name


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


def adopt(model: nn.Module) -> list:
    """The one change `tensor_parallel` makes to a model before sharding it: diffusers' GGUF and fp8r Linears become
    plain `nn.Linear`s over the same bytes (`surgery.core.prequantized`), which the stock styles and the checks take.
    Every replacement is built before the first is swapped in; returns what `unadopt` puts back (empty for a model
    without such Linears)."""
    return adopt_prequantized(model)


def unadopt(adopted: list) -> None:
    """Put back the Linears `adopt` replaced: a refused or failed verb leaves the model as it was."""
    restore_adopted(adopted)


def parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold `tensor`'s values: itself, or a quantized weight's inner tensors (values, scales), in
    the same order for a weight and the sharded one that replaces it. What sharding moves, frees and refills."""
    if quantized(tensor):
        return [part for part in _inner(tensor)[0].values() if part is not None]
    return [tensor]


def place_parameter(param: torch.Tensor, placement, mesh: DeviceMesh, src_data_rank: int | None,
                    path: str) -> tuple[nn.Parameter | None, nn.Parameter | None]:
    """(what the stock styles should find at `param`'s place, what takes its place after them); None: nothing.

    A plain weight not yet on the mesh's device becomes a DTensor, moving only this rank's shard (`place`); one
    already placed (a DTensor, on the mesh's device, or meta) is left to the styles. A quantized weight becomes
    torchao's own sharded layout (`shard_quantized`; as it is where a sharded load read this rank's cut), which the
    stock styles cannot take (they would `distribute_tensor` it): a meta DTensor of its placement stands in while
    they run, and the sharded weight (frozen, as quantized weights are) replaces it after them."""
    if not quantized(param):
        if isinstance(param, DTensor) or param.device.type == mesh.device_type or param.is_meta:
            return None, None
        return nn.Parameter(place(param.detach(), placement, mesh, src_data_rank), param.requires_grad), None
    sharded = param.detach() if mesh_of(param) is not None else shard_quantized(
        param.detach(), placement, mesh, src_data_rank, path)
    pieces = torch.empty(param.shape, device="meta").chunk(mesh.size(), placement.dim)
    stand_in = DTensor.from_local(pieces[mesh.get_local_rank()], mesh, (placement,), run_check=False)
    return nn.Parameter(stand_in, requires_grad=False), nn.Parameter(sharded, requires_grad=False)


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


def shard_quantized(tensor: torch.Tensor, placement, mesh: DeviceMesh, src_data_rank: int | None,
                    path: str) -> torch.Tensor:
    """The torchao tensor `tensor` (quantized whole) as torchao's own sharded layout on `mesh`: the same class around
    DTensor inner tensors, each this rank's cut (or whole) and moved to the mesh's device by `place`; an integer
    `src_data_rank` gives every rank that rank's values (a broadcast per inner shard)."""

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


_ENABLED = False


def enable_quantized_ops() -> None:
    """Teach DTensor the one op torchao's int8 dynamic-activation kernel adds: `aten._int_mm` (int8 x int8 -> int32)
    shards exactly like `aten.mm`, so a rowwise cut sums exact int32 partials across ranks."""
    global _ENABLED
    if _ENABLED:
        return
    register_op_strategy(torch.ops.aten._int_mm.default)(mm_strategy)
    _ENABLED = True
