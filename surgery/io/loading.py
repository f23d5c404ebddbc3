"""`load_tensor_parallel`: each rank reads only its own slices of a FLUX.2 checkpoint into the sharded unfused model."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from tqdm.auto import tqdm

from surgery.parallel.agreement import agree, fingerprint
from surgery.io.checkpoint import Reader, check_tensors, expected_tensors, layout_of, model_on_meta, resolve_checkpoint
from surgery.core.errors import SurgeryError
from surgery.core.optional import need
from surgery.core.prequantized import GGUFWeight, check_columns, type_name
from surgery.io.sliced_files import GGUFFile, SafetensorsFile, row_sources
from surgery.core.rewrite import unfuse
from surgery.core.slicing import Slice
from surgery.core.state_dict import weight_slices
from surgery.parallel.transformers_plans import checkpoint_renames
from surgery.parallel.plans import FilterFn
from surgery.parallel.plans import checked_plan, linear_placements, plan_digest
from surgery.parallel.distributed import one_dim_mesh
from surgery.parallel.tensor_parallel import apply_plans, pack_sharded


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
    dtypes) or read different files (each file's size and a digest of its header and of samples of its bytes) are
    refused.

    A pipeline's text encoder loads the same way: `subfolder="text_encoder"` (or the folder itself), a transformers
    class or None (the class in its config.json's `architectures`), its `model.safetensors` (sharded with
    `model.safetensors.index.json` too), sharded with transformers' own plan or a registered one.

    A single `.gguf` or `.safetensors` file (config.json beside it) loads per rank too, in diffusers' names or the
    original ones diffusers' single-file conversion maps: GGUF-quantized weights stay GGUF bytes (`GGUFWeight`),
    float8 weights with per-row `weight_scale`s (BFL's fp8r) become torchao `Float8Tensor`s; each rank reads only the
    bytes it holds (`_load_single_file`).

    `plan` and `filter_fn` are `tensor_parallel`'s: a literal plan instead of the registered ones, and the planned
    modules to keep (the others are read whole); the result equals `tensor_parallel(unfuse(fully_loaded), mesh, plan,
    filter_fn)`.
    """
    mesh = one_dim_mesh(mesh, "load_tensor_parallel")
    return agree(
        mesh, "load_tensor_parallel",
        lambda: _load_tensor_parallel(model, checkpoint, mesh, dtype=dtype, cache_dir=cache_dir, variant=variant,
                                      progress=progress, subfolder=subfolder, plan=plan, filter_fn=filter_fn),
        lambda loaded: _fingerprint(*loaded, mesh.size(), plan is not None or filter_fn is not None),
    )[0]


def _fingerprint(model: nn.Module, planned: list, files: dict[str, str], world: int, custom: bool
                 ) -> dict[str, dict]:
    parts = fingerprint(model, world, None, weights=False, files=files)
    if custom:  # ranks given different plans would shard differently
        parts["call"]["plan"] = plan_digest(planned)
    return parts


def _on_meta(model: type | nn.Module | None, folder: Path) -> nn.Module:
    if isinstance(model, nn.Module):
        on_meta = [n for n, p in model.named_parameters() if not p.is_meta]
        if on_meta:
            raise SurgeryError(f"load_tensor_parallel: pass a model built on the meta device; '{on_meta[0]}' is not.")
        return model
    return model_on_meta(folder, model)


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def _set(model: nn.Module, name: str, loaded: nn.Parameter, aliases: dict[str, list[str]]) -> None:
    for alias in (name, *aliases.get(name, ())):  # tied weights (a text encoder's embeddings) stay tied
        owner, _, leaf = alias.rpartition(".")
        setattr(model.get_submodule(owner), leaf, loaded)


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
) -> tuple[nn.Module, list, dict[str, str]]:
    """`load_tensor_parallel` on this rank alone (no collective): the model, its planned modules and what it read
    (`surgery.parallel.agreement.file_identity` by file name, for the ranks to compare)."""

    if str(checkpoint).endswith((".gguf", ".safetensors")):
        return _load_single_file(model, Path(checkpoint), mesh, dtype=dtype, progress=progress, plan=plan,
                                 filter_fn=filter_fn)
    folder = resolve_checkpoint(os.path.join(checkpoint, subfolder) if subfolder else checkpoint, cache_dir)
    model = _on_meta(model, folder)
    unfuse(model)
    planned = checked_plan(model, plan, filter_fn, mesh.size())
    placements = _placements(model, planned)
    slices = weight_slices(model)
    rank, world = mesh.get_local_rank(), mesh.size()
    device = _device(mesh)

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
            _set(model, name, nn.Parameter(local, requires_grad=param.requires_grad), aliases)

    return *_finish(model, planned, mesh), reader.identities


def _finish(model: nn.Module, planned: list, mesh: DeviceMesh) -> tuple[nn.Module, list]:
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise SurgeryError(f"load_tensor_parallel: {left[0]!r} is not in the checkpoint and has no initializer.")
    apply_plans(model, planned, mesh, src_data_rank=None)
    pack_sharded(model, planned, mesh)
    return model.eval(), planned



def _load_single_file(model: type | nn.Module | None, path: Path, mesh: DeviceMesh, *, dtype: torch.dtype | None,
                      progress: bool, plan: dict[str, ParallelStyle] | None, filter_fn: FilterFn | None
                      ) -> tuple[nn.Module, list, dict[str, str]]:
    """`load_tensor_parallel` of one .gguf or .safetensors file (config.json beside it, or a model built on meta), in
    diffusers' names or the original ones that diffusers' single-file conversion maps. Each rank reads only the bytes
    of its rows and columns of each tensor (and, for the ranks to compare, `file_identity`'s fixed few):
    - GGUF-quantized weights stay GGUF bytes, held as a `GGUFWeight` around a DTensor (`surgery.core.prequantized`); equals
      `tensor_parallel(unfuse(from_single_file(path, quantization_config=GGUFQuantizationConfig(compute_dtype=
      dtype))), mesh)`, the same bytes on each rank;
    - float8 weights with a per-row `weight_scale` (BFL's fp8r layout, what diffusers' `BFLQuantizationConfig` reads)
      become torchao `Float8Tensor`s (weight-only, per-row scale) around DTensors, the layout `tensor_parallel` gives a
      torchao-quantized model: each rank reads its rows and their scales (colwise) or its columns and every row's scale
      (rowwise). An `input_scale` is not read (diffusers' fp8r does not use it either);
    - every other tensor is read as its slice and cast to `dtype` (default float32, the dtype quantized weights
      dequantize to as well)."""
    if not path.is_file():
        raise SurgeryError(f"load_tensor_parallel: '{path}' is not a file.")
    model = _on_meta(model, path.parent)
    compute = dtype or torch.float32
    rank, world = mesh.get_local_rank(), mesh.size()
    device = _device(mesh)
    opened = GGUFFile(path) if path.suffix == ".gguf" else SafetensorsFile(path)
    with opened as file:
        scales = {n[: -len("_scale")]: n for n in file.tensors if n.endswith(".weight_scale")}
        skipped = {n for n in file.tensors if n.endswith((".input_scale", ".weight_scale_2"))}
        if any(n.endswith(".weight_scale_2") for n in skipped):
            raise SurgeryError(
                f"load_tensor_parallel: '{path}' holds NVFP4 weights ('weight_scale_2'); only fp8 weights with per-row "
                "scales (and GGUF) are read per rank. Load it with from_single_file(quantization_config="
                "BFLQuantizationConfig(...)) on each rank."
            )
        names = [n for n in file.tensors if n not in skipped and n not in scales.values()]
        rows_of = row_sources(model, file, names)  # the fused model's names
        unfuse(model)
        planned = checked_plan(model, plan, filter_fn, world)
        placements = _placements(model, planned)
        sources = {s.unfused: s for s in weight_slices(model)}
        aliases = _aliases(model)
        reads = []  # every read decided and checked before the first byte is read
        for name, param in model.named_parameters():
            source, placement = sources.get(name), placements.get(name)
            stored_name, rows = rows_of[source.fused if source else name]
            stored = file.tensors[stored_name]
            index = _source_index(param.shape, source, placement, rank, world)
            columns = slice(*index[1].indices(stored.shape[-1])[:2]) if param.ndim > 1 else None
            scale = scales.get(stored_name)
            if stored.quantized:
                _check_gguf_read(model, name, param, stored, columns)
            elif stored.dtype.itemsize == 1 and stored.dtype.is_floating_point:
                _check_fp8_read(model, name, stored, scale and file.tensors[scale], path)
            reads.append((name, param, placement, stored, scale, rows[index[0]].tolist(), columns))
        for name, param, placement, stored, scale, rows, columns in tqdm(
                reads, desc=f"loading {path.name} ({world} ranks)", disable=not progress or rank != 0):
            local = file.read(stored.name, rows, columns).to(device)
            if stored.quantized:
                local = GGUFWeight(_placed(local, placement, mesh), stored.ggml_type, param.shape, compute)
            elif scale is not None:
                # per-row scales follow the rows: cut with them (colwise), whole on every rank (rowwise)
                row_scale = file.read(scale, rows, None).to(device).float().reshape(-1, 1)
                scale_placement = placement if isinstance(placement, Shard) and placement.dim == 0 else None
                if placement is not None and scale_placement is None:
                    scale_placement = Replicate()
                local = _float8(_placed(local, placement, mesh), _placed(row_scale, scale_placement, mesh),
                                param.shape, compute)
            else:
                local = _placed(local.to(compute), placement, mesh)
            plain = not stored.quantized and scale is None
            _set(model, name, nn.Parameter(local, requires_grad=param.requires_grad and plain), aliases)
        read = {path.name: file.identity()}
    return *_finish(model, planned, mesh), read


def _placed(local: torch.Tensor, placement: Placement | None, mesh: DeviceMesh) -> torch.Tensor:
    return local if placement is None else DTensor.from_local(local, mesh, (placement,), run_check=False)


def _float8(qdata: torch.Tensor, scale: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """torchao's weight-only float8 tensor with a per-row scale (what `Float8WeightOnlyConfig()` builds) over
    `qdata` and `scale` (plain, or DTensors of this rank's cut)."""
    Float8Tensor = need("torchao.quantization", "load_tensor_parallel of fp8 weights with scales").Float8Tensor
    return Float8Tensor(qdata, scale, block_size=[1, shape[1]], dtype=dtype)


def _check_fp8_read(model: nn.Module, name: str, stored, scale, path: Path) -> None:
    """An fp8 tensor loads only as a Linear's weight with its per-row scale (one float per output row)."""
    owner, _, leaf = name.rpartition(".")
    if type(model.get_submodule(owner)) is not nn.Linear or leaf != "weight" or scale is None:
        raise SurgeryError(
            f"load_tensor_parallel: '{path}': '{stored.name}' is {stored.dtype} and would load into '{name}'"
            f"{'' if scale else ' without a weight_scale'}; only Linear weights with a per-row 'weight_scale' load "
            "as fp8."
        )
    if scale.shape != (stored.shape[0],):
        raise SurgeryError(
            f"load_tensor_parallel: '{path}': '{scale.name}' has shape {scale.shape}; a per-row scale of "
            f"'{stored.name}' {stored.shape} has shape {(stored.shape[0],)} (BFL's fp8r layout). Other scale layouts "
            "are not read per rank."
        )


def _check_gguf_read(model: nn.Module, name: str, param: torch.Tensor, stored, columns: slice | None) -> None:
    """A GGUF-quantized tensor loads only as a Linear's weight, cut on block boundaries."""
    owner, _, leaf = name.rpartition(".")
    keep = [m for m in getattr(model, "_keep_in_fp32_modules", None) or [] if m in name.split(".")]
    if keep:  # diffusers dequantizes these to float32 when it loads the file
        raise SurgeryError(
            f"load_tensor_parallel: '{stored.name}' is GGUF {type_name(stored.ggml_type)} and loads into '{name}', "
            f"which {type(model).__name__} keeps in float32 ('{keep[0]}'); per-rank reading keeps GGUF bytes. Load "
            "it with from_single_file, then surgery.unfuse and surgery.tensor_parallel."
        )
    if type(model.get_submodule(owner)) is not nn.Linear or leaf != "weight":
        raise SurgeryError(
            f"load_tensor_parallel: '{stored.name}' is GGUF {type_name(stored.ggml_type)} and would load into "
            f"'{name}', which is not an nn.Linear weight; only Linear weights run quantized. Dequantize it in the file."
        )
    if columns is not None:
        # the columns of the stored row this rank reads (a block boundary each, or a byte range would split a block)
        stored_weight = GGUFWeight(torch.empty(0, dtype=torch.uint8), stored.ggml_type, stored.shape, torch.float32)
        check_columns(stored_weight, columns.start, columns.stop, f"load_tensor_parallel: '{name}' ('{stored.name}')")
