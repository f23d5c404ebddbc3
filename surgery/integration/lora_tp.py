"""LoRA adapters on a model sharded by `surgery.tensor_parallel` (or `load_tensor_parallel`), without merging.

Each PEFT LoRA layer's factors are laid out by its base Linear's stock style (the plan beside the module):

- colwise base (`W` rows sharded): `lora_A` whole (a replicated DTensor: its input is replicated), `lora_B` rows
  sharded like the base, with a copy of the base's own `ColwiseParallel` style;
- rowwise base (`W` input columns sharded): `lora_A` input columns sharded, with a copy of the base's own
  `RowwiseParallel` style, so its output is reduced the way the base's is — left `Partial` where the base's is
  (it joins the block's one all-reduce: no extra collective), else all-reduced at the adapter's rank (r values per
  token); `lora_B` whole (a replicated DTensor).
- a Linear no plan shards keeps plain, whole factors.

PEFT's own TP support (`_hf_tp_plan` on base layers, `add_lora_tp_hooks_dtensor`) is written for transformers'
plan strings and styles (`"colwise"` / `"rowwise"` with an all-reduced output); it cannot express a `Partial`
output that joins the block's single all-reduce, so the layout is done here with torch's stock styles instead. Like
PEFT's, every factor is a DTensor of the adapter's global shape, so PEFT's own code keeps working on it unchanged:
`merge` / `unmerge` (`fuse_lora`, `unfuse_lora`: `B @ A` has the base weight's placement), `set_adapters` scales,
`delete_adapters`, `unload_lora`, hot-swap (`copy_` into the same placements), `get_peft_model_state_dict`.

Loading (`load_lora_adapter` / `load_lora_weights` on a sharded model, see `surgery.integration.diffusers_hooks`) reads only
this rank's slice of each factor (safetensors slices, through the same fused -> unfused split as an unsharded load)
and hands diffusers a state dict of DTensors: stock `load_lora_adapter` then builds the adapter's `LoraConfig`,
injects the layers on the meta device and assigns the DTensors (`low_cpu_mem_usage=True`).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable, Iterator, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from surgery.parallel.quantized import mesh_of
from diffusers.loaders.lora_base import LORA_WEIGHT_NAME
from diffusers.loaders.lora_base import LORA_WEIGHT_NAME_SAFE
from diffusers.loaders.lora_base import _best_guess_weight_name
from diffusers.utils import _get_model_file
from diffusers.utils.peft_utils import get_adapter_name
from pathlib import Path
from safetensors import safe_open
import hashlib
import json
from functools import partial
import os

from surgery.core.errors import SurgeryError
from surgery.core.heads_padding import trims
from surgery.core.optional import need
from surgery.integration.lora import split_adapter, stock_lora_adapter, write_adapter
from surgery.io.atomic import staged_folder
from surgery.parallel.agreement import PIECE, SAMPLE, agree, agree_and_share, sampled_checksum, tensors_identity
from surgery.parallel.plans import planned_modules
from surgery.parallel.quantized import place

__all__ = ["shard_lora", "linear_styles"]


def linear_styles(model: nn.Module) -> dict[str, ParallelStyle]:
    """Full path -> stock style of every Linear a tensor-parallel plan shards (colwise or rowwise)."""

    out = {}
    for path, _, plan in planned_modules(model):
        for key, style in plan.items():
            if isinstance(style, (ColwiseParallel, RowwiseParallel)):
                out[".".join(p for p in (path, key) if p)] = style
    return out


def _base_weight(layer: nn.Module) -> torch.Tensor:
    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
    return base.weight


def tp_mesh(model: nn.Module, styles: Mapping[str, ParallelStyle] | None = None):
    """The 1-D mesh the planned Linears of `model` are sharded over (None when the model is not sharded)."""
    styles = linear_styles(model) if styles is None else styles
    for path in styles:
        mesh = mesh_of(_base_weight(model.get_submodule(path)))  # a quantized weight's mesh is its inner tensors'
        if mesh is not None:
            return mesh
    return None


def _replicated_io(module: nn.Module, mesh, local_output: bool) -> None:
    """`module`'s parameters replicated DTensors; a plain input taken as replicated; output local if asked."""

    def input_fn(_, inputs, device_mesh):
        return tuple(x if isinstance(x, DTensor) or not isinstance(x, torch.Tensor)
                     else DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False) for x in inputs)

    def output_fn(_, output, device_mesh):
        return output.to_local() if local_output and isinstance(output, DTensor) else output

    distribute_module(module, mesh, input_fn=input_fn, output_fn=output_fn)


def _laid_out(module: nn.Module) -> bool:
    return getattr(module, "_distribute_module_applied", False)


def factor_placements(style: ParallelStyle) -> tuple[tuple, tuple]:
    """(lora_A placements, lora_B placements) for a base Linear of `style`."""
    if isinstance(style, ColwiseParallel):
        return (Replicate(),), (Shard(0),)
    return (Shard(1),), (Replicate(),)


def lay_out(a: nn.Module, b: nn.Module, base: nn.Linear, style: ParallelStyle, mesh,
            src_data_rank: int | None = None) -> None:
    """Give one adapter's `lora_A` / `lora_B` Linears of a base of `style` their placements and the style's hooks.

    Factors that are already DTensors (a sharded load) keep their values. Whole ones are placed (`src_data_rank`:
    the rank whose values every rank gets, as in `tensor_parallel`; None: each rank keeps its own). Factors PEFT
    sized to the base's local shard (it does so when the base weight's mesh has dim names other than "fsdp", as for
    transformers' TP) are this rank's shard already and become the DTensor they are a shard of.
    """

    for linear, placements, full in zip((a, b), factor_placements(style),
                                        ((None, base.in_features), (base.out_features, None))):
        for name, param in list(linear.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            if name == "weight":
                placement = placements[0]
                shape = torch.Size((param.shape[0] if full[0] is None else full[0],
                                    param.shape[1] if full[1] is None else full[1]))
            else:  # a LoRA bias (lora_B's): sharded with the base's rows, else whole
                placement = Shard(0) if isinstance(style, ColwiseParallel) and linear is b else Replicate()
                shape = torch.Size((base.out_features,))
            if param.shape == shape:
                tensor = place(param.detach(), placement, mesh, src_data_rank)
            else:
                tensor = DTensor.from_local(param.detach(), mesh, (placement,), run_check=False, shape=shape,
                                            stride=torch.empty(shape, device="meta").stride())
            setattr(linear, name, nn.Parameter(tensor, requires_grad=param.requires_grad))
    if isinstance(style, ColwiseParallel):
        if not _laid_out(a):
            _replicated_io(a, mesh, local_output=True)
        if not _laid_out(b):
            parallelize_module(b, mesh, copy.copy(style))
    else:
        if not _laid_out(a):
            parallelize_module(a, mesh, copy.copy(style))
        if not _laid_out(b):
            _replicated_io(b, mesh, local_output=style.use_local_output)


def shard_lora(model: nn.Module, mesh=None, *, src_data_rank: int | None = 0) -> nn.Module:
    """Lay out the PEFT LoRA layers of a tensor-parallel model for its shards; in place, returns `model`.

    For training: inject adapters after `surgery.tensor_parallel` (PEFT's `inject_adapter_in_model`,
    `model.add_adapter(LoraConfig(...))`, or `get_peft_model`), call this, then FSDP2's `fully_shard` (torchtitan's
    order). Each factor gets its base Linear's layout (see the module's docstring): no TP code in forward, the
    stock styles' hooks do the communication. `src_data_rank` (default 0) gives every rank that rank's initial
    factors, as `tensor_parallel` does for weights (PEFT draws `lora_A` at random on each rank); None keeps each
    rank's own (identical, e.g. seeded) factors with no collective. `mesh` defaults to the mesh of the base weights.
    Layers already laid out (adapters loaded with `load_lora_adapter` on the sharded model) are left as they are.
    Every rank calls it at the same point: a rank whose peers do not call it raises after the handshake timeout
    (`SURGERY_HANDSHAKE_TIMEOUT`), naming them, and a refusal on any rank raises on every rank before anything moves.
    """
    styles = linear_styles(model)
    mesh = mesh if mesh is not None else tp_mesh(model, styles)
    if mesh is None:
        raise SurgeryError("surgery.lora.shard_lora: the model is not sharded; call surgery.tensor_parallel(model, mesh) "
                           "first (then add the adapters, then shard_lora).")
    # every rank first (a rank alone would wait in the first broadcast forever): the handshake names a missing rank;
    # with src_data_rank=None each rank keeps its own factors, so they compare them (a sampled checksum each)
    weights = partial(_factor_checksums, model) if src_data_rank is None else None
    for layer, name, style in agree(mesh, "lora.shard_lora", lambda: _adapter_layers(model, styles), weights):
        lay_out(layer.lora_A[name], layer.lora_B[name], layer.get_base_layer(), style, mesh, src_data_rank)
    zero_padded_heads(model)
    return model


def _factor_checksums(model: nn.Module, layers: list) -> dict[str, dict]:
    """A sampled checksum of each whole factor not yet laid out (plain tensors: each rank's own), by its path.

    Factors PEFT sized to the base's local shard are each rank's own shard (see `lay_out`): they differ by design."""
    paths = {id(module): path for path, module in model.named_modules()}
    checksums = {}
    for layer, name, _ in layers:
        base = layer.get_base_layer()
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
        for kind, factor, whole in (("lora_A", a, (a.shape[0], base.in_features)),
                                    ("lora_B", b, (base.out_features, b.shape[1]))):
            if not isinstance(factor, DTensor) and tuple(factor.shape) == whole:
                checksums[f"{paths[id(layer)]}.{kind}.{name}.weight"] = sampled_checksum(factor)
    return {"weights": checksums}


def _padded_factors(model: nn.Module) -> Iterator[tuple[str, int, int, int]]:
    """`(factor key without the adapter name, dim, real size, padded size)` for each LoRA factor side that meets a
    zero head (`surgery.core.heads_padding`): lora_B's rows of a padded q/k/v, lora_A's columns of a padded output
    projection. Keys as PEFT's state dict writes them (`attn.to_q.lora_B.weight`)."""
    for name, (dim, real) in trims(model).items():
        module, _, leaf = name.rpartition(".")
        base = model.get_submodule(module)
        base = base.get_base_layer() if hasattr(base, "get_base_layer") else base
        padded = base.out_features if dim == 0 else base.in_features
        yield f"{module}.{'lora_B' if dim == 0 else 'lora_A'}.{leaf}", dim, real, padded


def zero_padded_heads(model: nn.Module) -> None:
    """Zero every adapter's factors where they meet a zero head, so that the padded heads stay zero: PEFT draws
    lora_A at random, and lora_A's columns of a padded output projection would read what a padded head's values
    became through lora_B. With both zero, their gradients are zero too, and training keeps them so."""
    with torch.no_grad():
        for key, dim, real, _ in _padded_factors(model):
            module, _, rest = key.rpartition(".lora_")
            factors = getattr(model.get_submodule(module), "lora_" + rest.partition(".")[0], {})
            for linear in factors.values():
                param = getattr(linear, rest.partition(".")[2], None)
                if param is not None:
                    _zero_from(param, dim, real)


def _zero_from(param: torch.Tensor, dim: int, start: int) -> None:
    """Zero `param[start:]` along `dim`, in global indices, on this rank's part of it."""
    local = param._local_tensor if isinstance(param, DTensor) else param
    offset = 0
    if isinstance(param, DTensor) and param.placements[0].is_shard(dim):
        offset = param.device_mesh.get_local_rank() * local.shape[dim]
    first = min(max(start - offset, 0), local.shape[dim])
    local.narrow(dim, first, local.shape[dim] - first).zero_()


def _adapter_layers(model: nn.Module, styles: dict) -> list:
    """(LoRA layer, adapter name, base style) for each adapter on a sharded Linear; refuses DoRA."""
    LoraLayer = need("peft.tuners.lora", "LoRA adapters").LoraLayer

    todo = []
    for path, style in styles.items():
        layer = model.get_submodule(path)
        if not isinstance(layer, LoraLayer):
            continue
        for name in layer.lora_A:
            if getattr(layer, "lora_magnitude_vector", None) and name in layer.lora_magnitude_vector:
                raise SurgeryError(f"surgery.lora.shard_lora: '{path}' holds a DoRA adapter {name!r}; DoRA's "
                                   "weight norm needs the whole base weight, which a sharded Linear does not hold.")
            todo.append((layer, name, style))
    return todo


# --- reading only this rank's slices ---------------------------------------------------------------------------------


class ZeroPadded:
    """A `LazyFactor` widened with zeros along `dim` to `size`: a stock adapter's factor on a model padded with zero
    heads (`zero_padded_heads` says why they must be zero)."""

    def __init__(self, factor: "LazyFactor", dim: int, size: int):
        self.factor, self.axis, self.dtype = factor, dim, factor.dtype
        self.shape = torch.Size(size if d == dim else n for d, n in enumerate(factor.shape))
        self.ndim = len(self.shape)

    def dim(self) -> int:
        return self.ndim

    def read(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        want = [rows or slice(None), cols or slice(None)]
        start, stop, _ = want[self.axis].indices(self.shape[self.axis])
        real = self.factor.shape[self.axis]
        want[self.axis] = slice(min(start, real), min(stop, real))
        got = self.factor.read(*want)
        missing = (stop - start) - got.shape[self.axis]
        if missing <= 0:
            return got
        shape = list(got.shape)
        shape[self.axis] = missing
        return torch.cat([got, got.new_zeros(shape)], self.axis)


class LazyFactor:
    """A factor of the adapter file not yet read: its shape, and the rows/columns of the stored tensor it stands for.

    Supports what the split of fused factors does (`x[a:b]`, `x[:, a:b]`, `.clone()`, `.shape`), so that
    `surgery.integration.lora`'s split runs on it unchanged; `read(rows, cols)` reads only that block (safetensors slices).
    """

    def __init__(self, read: Callable[[slice, slice], torch.Tensor], shape, dtype, rows=None, cols=None):
        self._read, self.dtype = read, dtype
        self.rows = rows if rows is not None else slice(0, shape[0])
        self.cols = cols if cols is not None or len(shape) < 2 else slice(0, shape[1])
        self.shape = torch.Size((self.rows.stop - self.rows.start,
                                 *(() if len(shape) < 2 else (self.cols.stop - self.cols.start,))))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return self.ndim

    def clone(self) -> "LazyFactor":
        return self

    def _sub(self, s: slice, base: slice, size: int) -> slice:
        start, stop, step = s.indices(size)
        if step != 1:
            raise SurgeryError("internal: a LoRA factor slice with a step")
        return slice(base.start + start, base.start + stop)

    def __getitem__(self, index) -> "LazyFactor":
        index = index if isinstance(index, tuple) else (index,)
        rows = self._sub(index[0], self.rows, self.shape[0])
        cols = self.cols if len(index) < 2 else self._sub(index[1], self.cols, self.shape[1])
        out = LazyFactor.__new__(LazyFactor)
        out._read, out.dtype, out.rows, out.cols = self._read, self.dtype, rows, cols
        out.shape = torch.Size((rows.stop - rows.start, *(() if cols is None else (cols.stop - cols.start,))))
        return out

    def read(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """This factor's block `[rows, cols]` (relative to the factor), read from the source alone."""
        sub = self[(rows or slice(None),) + ((cols or slice(None),) if self.cols is not None else ())]
        return sub._read(sub.rows, sub.cols)


def lazy_file(path: str) -> tuple[dict[str, LazyFactor], dict]:
    """The tensors of a safetensors file as `LazyFactor`s (nothing read yet), and its `__metadata__`."""

    handle = safe_open(path, framework="pt", device="cpu")
    return _lazy_factors(handle), handle.metadata() or {}


def _lazy_factors(handle) -> dict[str, LazyFactor]:
    out = {}
    for key in handle.keys():
        view = handle.get_slice(key)
        shape = view.get_shape()

        def read(rows, cols, key=key):
            s = handle.get_slice(key)
            return s[rows, cols] if cols is not None else s[rows]

        out[key] = LazyFactor(read, shape, view.get_dtype(), None, None)
    return out


def lazy_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, LazyFactor]:
    """An in-memory adapter (what `pipe.load_lora_weights` passes on) as `LazyFactor`s."""
    out = {}
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise SurgeryError(f"the adapter's {key!r} is a {type(value).__name__}, not a tensor.")

        def read(rows, cols, value=value):
            return value[rows, cols] if cols is not None else value[rows]

        out[key] = LazyFactor(read, tuple(value.shape), value.dtype)
    return out


def local_factor(factor: LazyFactor, placement, mesh, dtype: torch.dtype) -> DTensor:
    """This rank's part of `factor` (global shape kept) as a DTensor with `placement`: only that part is read."""
    shape = tuple(factor.shape)
    if isinstance(placement, Shard):
        size, world = shape[placement.dim], mesh.size()
        if size % world:
            raise SurgeryError(f"a factor of shape {shape} cannot be split {world} ways along dim {placement.dim}")
        step = size // world
        part = slice(mesh.get_local_rank() * step, (mesh.get_local_rank() + 1) * step)
        local = factor.read(part, None) if placement.dim == 0 else factor.read(None, part)
    else:
        local = factor.read()
    local = local.to(device=mesh.device_type, dtype=dtype).contiguous()
    return DTensor.from_local(local, mesh, (placement,), run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


@contextlib.contextmanager
def peft_on_dtensors() -> Iterator[None]:
    """While loading on a sharded model: PEFT sizes factors globally and pads them in place.

    - PEFT sizes a factor to the base weight's local shard when the weight's mesh has dim names (transformers' TP);
      the loaded factors are DTensors of the adapter's global shape, so the layers are sized globally here.
    - PEFT's `prepare_model_for_compiled_hotswap` pads by building new `nn.Linear`s from plain zeros, which would drop
      the factors' DTensor layout and their hooks; here each factor's local tensor is padded along the rank dim
      (never the sharded one) and the same module keeps it. The rest of PEFT's preparation (scalings as tensors,
      the config's rank) runs as it is.
    """
    hotswap = need("peft.utils.hotswap", "LoRA adapters")
    LoraLayer = need("peft.tuners.lora", "LoRA adapters").LoraLayer

    stock_pad, stock_features = hotswap._pad_lora_weights, LoraLayer._get_in_out_features

    def features(self, module):
        if isinstance(module, nn.Linear):
            return module.in_features, module.out_features
        return stock_features(self, module)

    hotswap._pad_lora_weights, LoraLayer._get_in_out_features = pad_lora_weights, features
    try:
        yield
    finally:
        hotswap._pad_lora_weights, LoraLayer._get_in_out_features = stock_pad, stock_features


def pad_lora_weights(model: nn.Module, target_rank: int) -> bool:
    """`peft.utils.hotswap._pad_lora_weights` for factors that may be DTensors: in place, module and hooks kept."""
    LoraLinear = need("peft.tuners.lora", "LoRA adapters").Linear

    found = False
    for module in model.modules():
        if not isinstance(module, LoraLinear):
            continue
        found = True
        for factors, dim in ((module.lora_A, 0), (module.lora_B, 1)):
            for linear in factors.values():
                weight = linear.weight
                rank = weight.shape[dim]
                if rank > target_rank:
                    raise ValueError(f"Trying to pad the adapter to the target rank {target_rank}, but the original "
                                     f"rank is larger ({rank}). This is not possible.")
                if rank == target_rank:
                    continue
                local = weight.to_local() if isinstance(weight, DTensor) else weight
                pad = [0, 0, 0, target_rank - rank] if dim == 0 else [0, target_rank - rank]
                padded = torch.nn.functional.pad(local.detach(), pad)
                if isinstance(weight, DTensor):
                    shape = list(weight.shape)
                    shape[dim] = target_rank
                    padded = DTensor.from_local(padded, weight.device_mesh, weight.placements, run_check=False,
                                                shape=torch.Size(shape),
                                                stride=torch.empty(shape, device="meta").stride())
                linear.weight = nn.Parameter(padded, requires_grad=weight.requires_grad)
                if dim == 0:
                    linear.out_features = target_rank
                else:
                    linear.in_features = target_rank
    return found


# --- load_lora_adapter on a sharded model ----------------------------------------------------------------------------


def _open(source, kwargs: dict) -> tuple[dict[str, LazyFactor], dict | None, dict[str, str]]:
    """The adapter `source` (a state dict, a safetensors file, a folder or a Hub id in the local cache) as
    `LazyFactor`s, diffusers' LoRA metadata (the adapter's `LoraConfig` dict), as diffusers resolves files, and what
    was read for the ranks to compare (`file_identity` by file name, or `tensors_identity` of a state dict)."""

    metadata = kwargs.pop("metadata", None)
    names = ("weight_name", "use_safetensors", "local_files_only", "cache_dir", "force_download", "proxies", "token",
             "revision", "subfolder")
    opts = {n: kwargs.pop(n, None) for n in names}
    if isinstance(source, Mapping):
        return lazy_dict(source), metadata, {"the adapter's state dict": tensors_identity(source)}

    source = str(source)
    weight_name = opts["weight_name"]
    if os.path.isfile(source):
        path = source
    else:
        if weight_name is None:
            weight_name = _best_guess_weight_name(source, file_extension=".safetensors",
                                                  local_files_only=opts["local_files_only"])
        if weight_name is not None and not weight_name.endswith(".safetensors"):
            raise SurgeryError(f"'{weight_name}' is not a safetensors file; on a sharded model each rank reads its "
                               "slices of the adapter, which needs safetensors. Convert it first.")
        path = _get_model_file(source, weights_name=weight_name or LORA_WEIGHT_NAME_SAFE,
                               cache_dir=opts["cache_dir"], force_download=opts["force_download"] or False,
                               proxies=opts["proxies"], local_files_only=opts["local_files_only"],
                               token=opts["token"], revision=opts["revision"], subfolder=opts["subfolder"],
                               user_agent={"file_type": "attn_procs_weights", "framework": "pytorch"})
    try:
        lazy, file_metadata = lazy_file(path)
    except Exception as error:  # safetensors raises its own error types for a truncated or corrupt header
        raise SurgeryError(f"cannot read the adapter file '{path}': {error}. Is it a complete safetensors file? "
                           "Download it again.") from None
    if metadata is None and LORA_ADAPTER_METADATA_KEY in file_metadata:
        metadata = json.loads(file_metadata[LORA_ADAPTER_METADATA_KEY])
    return lazy, metadata, {os.path.basename(path): _tensors_in_file(path)}


def _tensors_in_file(path: str) -> str:
    """What the ranks compare of an adapter file: its tensors' entries and samples of their bytes (`file_identity`'s
    pieces). Not the `__metadata__` text: copies of one adapter written by different processes order its lists
    differently."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        digest = hashlib.blake2b(json.dumps(header, sort_keys=True).encode(), digest_size=8)
        start, data = 8 + size, os.fstat(f.fileno()).st_size - 8 - size
        for i in range(SAMPLE):
            digest.update(os.pread(f.fileno(), PIECE, start + i * max(data - PIECE, 0) // (SAMPLE - 1)))
    return f"{data} bytes of tensors, digest {digest.hexdigest()}"


def _check(model: nn.Module, state: dict[str, LazyFactor], head: str, adapter_name: str, hotswap: bool,
           verb: str, source_name: str) -> None:
    """Everything a load could trip on, before anything changes: names, widths, ranks, the adapter name."""
    LoraLayer = need("peft.tuners.lora", "LoRA adapters").LoraLayer

    existing = getattr(model, "peft_config", {})
    if hotswap and adapter_name not in existing:
        raise SurgeryError(f"{verb}: hotswap=True but the model has no adapter {adapter_name!r} to swap "
                           f"(it has {sorted(existing)}). Load one first without hotswap.")
    if not hotswap and adapter_name in existing:
        raise SurgeryError(f"{verb}: the model already has an adapter named {adapter_name!r}; pass another "
                           "adapter_name, delete_adapters it first, or hotswap=True.")
    kind = type(model).__name__
    for key, factor in state.items():
        if not key.startswith(head):
            continue
        name = key[len(head):]
        module_path, _, leaf = name.rpartition(".lora_")
        if leaf not in ("A.weight", "B.weight"):
            raise SurgeryError(f"{verb}: '{key}' of {source_name} is not a plain LoRA factor (lora_A / lora_B "
                               "weight); DoRA magnitudes, LoRA biases and other adapter kinds are not supported on a "
                               "sharded model. Load it before sharding and merge it (fuse_lora; unload_lora).")
        try:
            module = model.get_submodule(module_path)
        except AttributeError:
            module = None
        if isinstance(module, LoraLayer):
            module = module.get_base_layer()
        if not isinstance(module, nn.Linear):
            raise SurgeryError(
                f"{verb}: {source_name} targets '{module_path}', which is "
                f"{'not a module' if module is None else 'a ' + type(module).__name__ + ', not a Linear'} of this "
                f"{kind}: it was made for another model family or version. Load an adapter made for {kind}.")
        want = (factor.shape[0], module.in_features) if leaf == "A.weight" else (module.out_features, factor.shape[1])
        if factor.ndim != 2 or tuple(factor.shape) != want:
            side = "input" if leaf == "A.weight" else "output"
            raise SurgeryError(
                f"{verb}: '{key}' of {source_name} has shape {tuple(factor.shape)}, but '{module_path}' has "
                f"{module.in_features if side == 'input' else module.out_features} {side} features (expected {want}): "
                "the adapter was made for another width or config of this model. Load one made for this config.")
        if hotswap:
            layer = model.get_submodule(module_path)
            if not isinstance(layer, LoraLayer) or adapter_name not in layer.lora_A:
                raise SurgeryError(f"{verb}: the adapter to hot-swap in targets '{module_path}', which adapter "
                                   f"{adapter_name!r} does not; a hot-swap can only replace the same layers.")
            have = layer.lora_A[adapter_name].weight.shape[0]
            rank = factor.shape[0] if leaf == "A.weight" else factor.shape[1]
            if rank > have:
                raise SurgeryError(
                    f"{verb}: '{key}' has rank {rank}, larger than the {have} that adapter {adapter_name!r} holds at "
                    f"'{module_path}'. Call enable_lora_hotswap(target_rank={rank}) (or more) before loading the "
                    "first adapter, or load this one under a new name.")


def load_sharded(model: nn.Module, source, prefix: str | None, hotswap: bool, kwargs: dict):
    """`load_lora_adapter` on a tensor-parallel model: each rank reads its slices; diffusers does the rest.

    Every rank calls it (as every rank loaded the model). The ranks agree on the checks' verdict first
    (`surgery.parallel.agreement.agree`), so a bad adapter raises the same error everywhere and changes nothing; the load
    itself runs no collective; a failure during it on any rank removes the adapter on every rank and is raised on
    every rank.
    """


    verb = f"{type(model).__name__}.load_lora_adapter"
    said = f"surgery.{verb}"
    styles = linear_styles(model)
    mesh = tp_mesh(model, styles)
    if mesh is None or mesh.ndim != 1:
        raise SurgeryError(f"{verb}: the model's sharded Linears sit on a {getattr(mesh, 'ndim', 0)}-D mesh; load "
                           "adapters on the tensor-parallel model before FSDP's fully_shard.")
    kwargs = dict(kwargs)
    adapter_name = kwargs.pop("adapter_name", None) or get_adapter_name(model)
    kwargs.pop("low_cpu_mem_usage", None)
    source_name = f"the adapter '{source}'" if not isinstance(source, Mapping) else "the adapter"
    head = f"{prefix}." if prefix else ""

    def check():
        state, metadata, read = _open(source, kwargs)
        alphas = kwargs.pop("network_alphas", None)
        state, metadata, alphas = split_adapter(model, dict(state), prefix, metadata, alphas)
        for key, dim, real, padded in _padded_factors(model):  # a stock adapter's factors meet zero heads
            factor = state.get(head + key)
            if factor is not None and factor.ndim == 2 and factor.shape[dim] == real:
                state[head + key] = ZeroPadded(factor, dim, padded)
        _check(model, state, head, adapter_name, hotswap, said, source_name)
        return state, metadata, alphas, read

    # ranks that read different adapters (another file, or a file replaced while they read) would each hold a
    # different adapter: they compare what they read first
    (state, metadata, alphas, _), names = agree_and_share(mesh, verb, check, lambda _: adapter_name,
                                                          lambda checked: {"files": checked[3]})
    if len(set(names)) > 1:  # each rank would hold its adapter under another name: later calls by name would part
        odd = next(r for r, n in enumerate(names) if n != names[0])
        raise SurgeryError(f"{said}: rank {odd} loads the adapter as {names[odd]!r}, rank 0 as {names[0]!r}; nothing "
                           "was loaded. Pass the same adapter_name on every rank.")
    params = dict(model.named_parameters())
    tensors = {}
    for key, factor in state.items():
        if not key.startswith(head):
            continue
        module_path = key[len(head):].rpartition(".lora_")[0]
        base = model.get_submodule(module_path)
        weight = _base_weight(base)
        style = styles.get(module_path)
        if style is None:
            tensors[key] = factor.read().to(device=weight.device, dtype=weight.dtype)
            continue
        a, b = factor_placements(style)
        placement = (a if ".lora_A." in key else b)[0]
        tensors[key] = local_factor(factor, placement, mesh, weight.dtype)
    del params
    error: BaseException | None = None
    try:
        with peft_on_dtensors():
            type(model).load_lora_adapter(model, tensors, prefix=prefix, hotswap=hotswap, metadata=metadata,
                                          network_alphas=alphas, adapter_name=adapter_name,
                                          low_cpu_mem_usage=True, **kwargs)
        # inside this verb, which every rank entered: no agreement of its own, and with no source rank no collective
        for layer, name, style in _adapter_layers(model, styles):
            lay_out(layer.lora_A[name], layer.lora_B[name], layer.get_base_layer(), style, mesh, None)
    except BaseException as caught:  # noqa: BLE001 - every rank hears of it below
        error = caught

    def done():
        if error is not None:
            raise error

    try:
        agree(mesh, verb, done, during="while loading the adapter")
    except BaseException:
        if error is None and not hotswap and adapter_name in getattr(model, "peft_config", {}):
            model.delete_adapters(adapter_name)
        raise


class _World:
    """The default process group as `surgery.parallel.agreement.agree` sees a mesh (its size and group)."""

    ndim = 1

    def size(self) -> int:
        return torch.distributed.get_world_size()

    def get_group(self):
        return torch.distributed.group.WORLD


def save_sharded(model: nn.Module, save_directory, adapter_name: str, safe_serialization: bool,
                 weight_name: str | None, upcast: bool = False) -> None:
    """`save_lora_adapter` on a tensor-parallel model: every rank calls it; the factors are gathered one at a time
    (`surgery.lora.stock_lora_adapter`), rank 0 writes the stock file into a temporary sibling folder swapped into place
    (`surgery.io.atomic.staged_folder`; other files in the folder are kept), and every rank returns once it is written
    or raises the same error."""



    verb = f"{type(model).__name__}.save_lora_adapter"
    mesh = tp_mesh(model)
    if mesh is None or mesh.ndim > 1:  # FSDP2 over TP: gathering a factor involves every rank, so all agree
        mesh = _World()
    target = Path(save_directory)
    name = weight_name or (LORA_WEIGHT_NAME_SAFE if safe_serialization else LORA_WEIGHT_NAME)

    def check():
        if adapter_name not in getattr(model, "peft_config", {}):
            raise SurgeryError(f"{verb}: the model has no LoRA adapter named {adapter_name!r} "
                               f"(it has {sorted(getattr(model, 'peft_config', {}))}).")
        if target.is_file():
            raise SurgeryError(f"{verb}: '{target}' is a file; pass a folder.")

    shared = agree_and_share(mesh, verb, check, lambda _: (os.path.abspath(target), adapter_name))[1]
    folders = [folder for folder, _ in shared]
    if len(set(folders)) > 1:  # rank 0 alone writes: another rank's folder would stay empty, unseen
        odd = next(r for r, f in enumerate(folders) if f != folders[0])
        raise SurgeryError(f"surgery.{verb}: rank {odd} saves into '{folders[odd]}', rank 0 into '{folders[0]}'; "
                           "nothing was written. Pass the same folder on every rank (rank 0 writes it).")
    names = [name for _, name in shared]
    if len(set(names)) > 1:  # each rank would gather another adapter's factors into one file
        odd = next(r for r, n in enumerate(names) if n != names[0])
        raise SurgeryError(f"surgery.{verb}: rank {odd} saves the adapter {names[odd]!r}, rank 0 {names[0]!r}; "
                           "nothing was written. Pass the same adapter_name on every rank.")
    if upcast:
        model.to(dtype=torch.float32)
    state_dict, config = stock_lora_adapter(model, adapter_name)  # collectives: every rank, same order
    error: BaseException | None = None
    if torch.distributed.get_rank() == 0:  # one writer, also when several TP groups (data-parallel) call it
        try:
            with staged_folder(target, owned=lambda entry: entry == name) as staged:
                write_adapter(staged / name, state_dict, config, safe_serialization)
        except BaseException as caught:  # noqa: BLE001 - every rank hears of it below
            error = caught

    def done():
        if error is not None:
            raise error

    agree(mesh, verb, done, during=f"while writing the adapter ('{target}' is as it was)")
