"""`load_tensor_parallel`: each rank reads only its own slices of a FLUX.2 checkpoint into the sharded unfused model."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from tqdm.auto import tqdm

from surgery.parallel.agreement import agree, fingerprint
from surgery.io.checkpoint import Reader, check_tensors, expected_tensors, layout_of, model_on_meta, resolve_checkpoint
from surgery.core.errors import SurgeryError
from surgery.core.rewrite import unfuse
from surgery.core.slicing import Slice
from surgery.core.state_dict import weight_slices
from surgery.parallel.transformers_plans import checkpoint_renames
from surgery.parallel.plans import FilterFn
from surgery.parallel.plans import checked_plan, linear_placements, plan_digest
from surgery.parallel.tensor_parallel import apply_plans, one_dim_mesh, pack_sharded


def _placements(model: nn.Module, planned: list) -> dict[str, Placement]:
    """Parameter name -> placement, for every parameter a stock linear style shards."""
    out: dict[str, Placement] = {}
    for path, module, plan in planned:
        for key, style in plan.items():
            placements = linear_placements(style, module.get_submodule(key))
            if placements is None:
                continue
            prefix = ".".join(p for p in (path, key) if p)
            for name, _ in module.get_submodule(key).named_parameters(recurse=False):
                out[f"{prefix}.{name}"] = placements[name][0]
    return out


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """A shared parameter's first name -> its other names (tied input and output embeddings)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {group[0]: group[1:] for group in names.values() if len(group) > 1}


def _source_index(
    shape: torch.Size, source: Slice | None, placement: Placement | None, rank: int, world: int
) -> tuple[slice, ...]:
    """Which part of the checkpoint tensor is this rank's piece of an unfused parameter of `shape`."""
    index = [slice(None)] * len(shape)
    if source is not None:
        index[source.dim] = slice(source.start, source.stop)
    if isinstance(placement, Shard):
        dim, chunk = placement.dim, shape[placement.dim] // world
        base = source.start if source is not None and source.dim == dim else 0
        index[dim] = slice(base + rank * chunk, base + (rank + 1) * chunk)
    return tuple(index)


def load_tensor_parallel(
    model: type | nn.Module | None,
    checkpoint: str | os.PathLike,
    mesh: DeviceMesh,
    *,
    dtype: torch.dtype | None = None,
    cache_dir: str | os.PathLike | None = None,
    variant: str | None = None,
    progress: bool = True,
    subfolder: str | None = None,
    plan: dict[str, ParallelStyle] | None = None,
    filter_fn: FilterFn | None = None,
) -> nn.Module:
    """Build the model on meta, unfuse it, and read only this rank's slice of each tensor from `checkpoint`.

    `model`: a diffusers model class (None: the class named in config.json), or a module built on the meta device.
    `checkpoint`: a diffusers model folder, a pipeline folder (`transformer/`), or a repo id in the local Hugging
    Face cache; safetensors, single file or sharded with an index, in the fused (diffusers) or unfused layout.
    Files are picked as diffusers picks them (index, else `diffusion_pytorch_model.safetensors`; `variant` as in
    `from_pretrained`), and every tensor's name, shape and dtype is checked before any is read: a checkpoint mixing
    dtypes is cast only with an explicit `dtype`, a non-floating tensor never. Replicated tensors are read whole.
    The result equals `tensor_parallel(unfuse(fully_loaded), mesh)` bitwise, on the mesh's device. Peak host memory
    is about this rank's shard plus the largest tensor it reads.

    Loading runs no collective; the ranks then agree (`surgery.parallel.agreement`) before returning, so that a rank
    that failed (a missing file, a bad tensor) makes every rank raise the same `SurgeryError` instead of leaving the
    others to wait in the model's first collective, and ranks that built different models (class, config, shapes,
    dtypes) are refused.

    A pipeline's text encoder loads the same way: `subfolder="text_encoder"` (or the folder itself), a transformers
    class or None (the class in its config.json's `architectures`), its `model.safetensors` (sharded with
    `model.safetensors.index.json` too), sharded with transformers' own plan or a registered one.

    `plan` and `filter_fn` are `tensor_parallel`'s: a literal plan instead of the registered ones, and the planned
    modules to keep (the others are read whole); the result equals `tensor_parallel(unfuse(fully_loaded), mesh, plan,
    filter_fn)`.
    """
    mesh = one_dim_mesh(mesh)
    return agree(
        mesh, "load_tensor_parallel",
        lambda: _load_tensor_parallel(model, checkpoint, mesh, dtype=dtype, cache_dir=cache_dir, variant=variant,
                                      progress=progress, subfolder=subfolder, plan=plan, filter_fn=filter_fn),
        lambda loaded: _fingerprint(loaded[0], loaded[1], mesh.size(), plan is not None or filter_fn is not None),
    )[0]


def _fingerprint(model: nn.Module, planned: list, world: int, custom: bool) -> dict[str, dict]:
    parts = fingerprint(model, world, None, weights=False)
    if custom:  # ranks given different plans would shard differently
        parts["call"]["plan"] = plan_digest(planned)
    return parts


def _load_tensor_parallel(
    model: type | nn.Module | None,
    checkpoint: str | os.PathLike,
    mesh: DeviceMesh,
    *,
    dtype: torch.dtype | None = None,
    cache_dir: str | os.PathLike | None = None,
    variant: str | None = None,
    progress: bool = True,
    subfolder: str | None = None,
    plan: dict[str, ParallelStyle] | None = None,
    filter_fn: FilterFn | None = None,
) -> tuple[nn.Module, list]:
    """`load_tensor_parallel` on this rank alone (no collective): the model and its planned modules."""

    folder = resolve_checkpoint(os.path.join(checkpoint, subfolder) if subfolder else checkpoint, cache_dir)
    if isinstance(model, nn.Module):
        on_meta = [n for n, p in model.named_parameters() if not p.is_meta]
        if on_meta:
            raise SurgeryError(f"load_tensor_parallel: pass a model built on the meta device; '{on_meta[0]}' is not.")
    else:
        model = model_on_meta(folder, model)
    unfuse(model)
    planned = checked_plan(model, plan, filter_fn, mesh.size())
    placements = _placements(model, planned)
    slices = weight_slices(model)
    rank, world = mesh.get_local_rank(), mesh.size()
    device = torch.device("cpu")
    if mesh.device_type != "cpu":
        device = torch.device(mesh.device_type, torch.accelerator.current_device_index())

    with Reader(folder, variant) as reader:
        reader.rename(checkpoint_renames(model, set(reader.files)))
        layout = layout_of(set(reader.files), slices)
        check_tensors(reader, expected_tensors(model, slices, layout), mixed_dtypes=dtype is not None)
        sources = {s.unfused: s for s in slices} if layout == "fused" else {}
        names = [name for name, _ in model.named_parameters()]
        aliases = _aliases(model)
        for name in tqdm(names, desc=f"loading {folder.name} ({world} ranks)", disable=not progress or rank != 0):
            param = model.get_parameter(name)
            source = sources.get(name)
            placement = placements.get(name)
            local = reader.read(source.fused if source else name,
                                _source_index(param.shape, source, placement, rank, world))
            local = local.to(device=device, dtype=dtype or local.dtype).contiguous()
            if placement is not None:
                local = DTensor.from_local(local, mesh, (placement,), run_check=False)
            loaded = nn.Parameter(local, requires_grad=param.requires_grad)
            for alias in (name, *aliases.get(name, ())):  # tied weights (a text encoder's embeddings) stay tied
                owner, _, leaf = alias.rpartition(".")
                setattr(model.get_submodule(owner), leaf, loaded)

    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise SurgeryError(f"load_tensor_parallel: {left[0]!r} is not in the checkpoint and has no initializer.")
    apply_plans(model, planned, mesh, src_data_rank=None)
    pack_sharded(model, planned, mesh)
    return model.eval(), planned

