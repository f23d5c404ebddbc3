"""Leaves that take a fused Linear's place behind the stock call: the stock block and its forward stay diffusers' own.

`SplitProjection` replaces a Linear that reads a concatenation, `proj_out(cat([attn, mlp], -1))` (the single-stream
blocks of FLUX.1, Chroma, HunyuanVideo, ...; FLUX.2's `to_out`): split by columns, the same projection is
`attn_part(attention output) + mlp_part(MLP hidden)` (the bias, whole, on `attn_part`). It still takes the
concatenation and cuts it by the ratio of its parts' widths, `attn_in / (attn_in + mlp_in)` of `x.shape[-1]`: true on
the whole model and on every rank of a column-sharded one (each rank holds the same fraction of both), so the stock
forward runs unchanged. Both parts shard rowwise, leave partial sums, and one all-reduce resolves their sum. For inference the two parts are
laid out in one buffer and multiplied at once (below).

`SplitRows` replaces a Linear whose output rows are several projections (q, k, v; SwiGLU gate and up; FLUX.2's
q, k, v, gate, up): it returns `cat([part(x) for part in parts], -1)`, which is what the fused Linear returns on the
whole model and, column-sharded, each rank's share of every part in the same order, so a stock `chunk(2)` or a
split by the parts' ratio still finds each part.

The children's names are chosen not to collide with the name patterns diffusers' features use: TaylorSeer hooks
every module whose path fully matches `^single_transformer_blocks.*attn` (so no child may end in `attn`), and stock
LoRA `target_modules` such as `to_q`, `to_k`, `to_v` are matched as suffixes (so no child may be called that).

One GEMM per fused weight. Where a leaf's parts' values lie back to back in one buffer, the leaf holds a `Packed`
over that buffer and multiplies by it once: the fused model's GEMM (diffusers' packed GEMM per rank), no `cat` of
the parts' outputs. The parts stay separate Linears (plans, LoRA, saving, the optimizer see them), and the leaf runs
their own forwards instead wherever a part does more than a plain matmul: a wrapper or another class (PEFT's LoRA
layers), a hook other than those its style set when packed (diffusers' hooks: layerwise casting, offloading), a
replaced parameter, or a gradient to compute. `Packed.holds` looks at the parts on every call; it costs a few
attribute reads.

Rows (a `SplitRows`) are packed for good: row parts are contiguous views of the fused storage (per rank, each rank's
local shards laid out so by `surgery.parallel.tensor_parallel`). Columns (a `SplitProjection`) are packed only for
inference: in one `[out, in]` buffer each column part is a non-contiguous view, which FSDP2's `fully_shard` refuses
("does not support non-contiguous parameters yet"). So `unfuse` gives them contiguous copies of their own, and the
model's forward pre-hook `pack_for_inference` lays them out in one buffer on the first forward run for inference
(module in eval mode, autograd off), before any compiled block runs; `train()` gives each part its own contiguous
copy again. A model unfused, sharded and not yet run for inference is what `fully_shard` takes; one that ran
inference is after `model.train()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from surgery.core.slicing import Slice, back_to_back, column_slices, row_slices

ATTN_PART, MLP_PART = "attn_part", "mlp_part"


def linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    """`nn.Linear(in_features, out_features, bias)`; on the meta device (where every leaf is built before its weights
    are filled) without running its random initialization, which has nothing to initialize there and took half of
    `unfuse`'s time at published widths."""
    if torch.get_default_device().type != "meta":
        return nn.Linear(in_features, out_features, bias=bias)
    module = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(module)
    module.in_features, module.out_features = in_features, out_features
    module.weight = nn.Parameter(torch.empty(out_features, in_features))
    module.register_parameter("bias", nn.Parameter(torch.empty(out_features)) if bias else None)
    return module


class SplitLeaf(nn.Module):
    """What both leaves share: their parts are their children, in order; a call multiplies once by their `Packed`
    buffer where it holds the parts as they are, else runs the parts' own forwards (`forward_parts`)."""

    def parts_list(self) -> list[nn.Module]:
        return list(self._modules.values())

    def _apply(self, fn, recurse=True):
        return repacked(self, super()._apply, fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.__dict__.get(PACKED)
        if packed is not None and packed.holds(self.parts_list()):
            return packed(x)
        return self.forward_parts(x)


class SplitProjection(SplitLeaf):
    """What `nn.Linear(attn_features + mlp_features, out_features)(cat([a, m], -1))` computes, as
    `attn_part(a) + mlp_part(m)`; called on the concatenation, like the Linear it replaces."""

    def __init__(self, attn_features: int, mlp_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.attn_part = linear(attn_features, out_features, bias=bias)
        self.mlp_part = linear(mlp_features, out_features, bias=False)

    @property
    def in_features(self) -> int:
        return self.attn_part.in_features + self.mlp_part.in_features

    @property
    def out_features(self) -> int:
        return self.attn_part.out_features

    @property
    def has_bias(self) -> bool:
        return self.attn_part.bias is not None

    def train(self, mode: bool = True):
        super().train(mode)
        if mode:  # contiguous parts again: what FSDP2 and the optimizers' training take
            unpack(self)
        return self

    def forward_parts(self, x: torch.Tensor) -> torch.Tensor:
        attn, mlp = self.attn_part.in_features, self.mlp_part.in_features
        width = x.shape[-1] * attn // (attn + mlp)  # the attention's share of the (local) concatenation
        return self.attn_part(x[..., :width]) + self.mlp_part(x[..., width:])


def split_projection_slices(name: str, module: nn.Module, attn_features: int | None = None) -> list[Slice]:
    """The slices between a fused `nn.Linear` called `name` and its `SplitProjection`: input columns, attention
    first, the bias whole on the attention part. `module` is either form; for the fused `nn.Linear`,
    `attn_features` says how many of its input columns read the attention output."""
    if isinstance(module, SplitProjection):
        attn, mlp = module.attn_part.in_features, module.mlp_part.in_features
        out, bias = module.attn_part.out_features, module.attn_part.bias is not None
    else:
        attn, mlp = attn_features, module.in_features - attn_features
        out, bias = module.out_features, module.bias is not None
    first = f"{name}.{ATTN_PART}"
    return column_slices(name, [(first, attn), (f"{name}.{MLP_PART}", mlp)], first if bias else None, out)


def split_projection_like(linear: nn.Linear, attn_features: int) -> SplitProjection:
    """An empty `SplitProjection` (on meta) with the shapes of fused `linear`, attention first."""
    with torch.device("meta"):
        return SplitProjection(
            attn_features, linear.in_features - attn_features, linear.out_features, linear.bias is not None
        )


def fused_linear_like(split: nn.Module) -> nn.Linear:
    """An empty fused `nn.Linear` (on meta) with the shapes of `split` (a `SplitProjection` or a `SplitRows`)."""
    with torch.device("meta"):
        return linear(split.in_features, split.out_features, bias=split.has_bias)


class SplitRows(SplitLeaf):
    """What a Linear whose output rows are the named parts, in order, computes: `cat([part(x) ...], -1)`."""

    def __init__(self, in_features: int, parts: list[tuple[str, int]], bias: bool = False):
        super().__init__()
        for name, size in parts:
            self.add_module(name, linear(in_features, size, bias=bias))

    @property
    def in_features(self) -> int:
        return next(iter(self._modules.values())).in_features

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self._modules.values())

    @property
    def has_bias(self) -> bool:
        return next(iter(self._modules.values())).bias is not None

    def parts(self) -> list[tuple[str, int]]:
        return [(name, part.out_features) for name, part in self._modules.items()]

    def forward_parts(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self._modules.values()], dim=-1)


def split_rows_slices(name: str, module: nn.Module, parts: list[tuple[str, int]] | None = None) -> list[Slice]:
    """The slices between a fused `nn.Linear` called `name` and its `SplitRows` (rows, in the parts' order).
    `module` is either form; `parts` gives the parts' names and sizes (required for the fused `nn.Linear`; for a
    `SplitRows`, its own sizes where not given)."""
    if parts is None:
        parts = module.parts()
    bias = module.has_bias if isinstance(module, SplitRows) else module.bias is not None
    named = [(f"{name}.{part}", size) for part, size in parts]
    return row_slices(name, named, "weight") + (row_slices(name, named, "bias") if bias else [])


def split_rows_like(linear: nn.Linear, parts: list[tuple[str, int]]) -> SplitRows:
    """An empty `SplitRows` (on meta) with the shapes of fused `linear`."""
    if sum(size for _, size in parts) != linear.out_features:
        raise ValueError(f"parts {parts} do not add up to the fused Linear's {linear.out_features} output features")
    with torch.device("meta"):
        return SplitRows(linear.in_features, parts, linear.bias is not None)


# --- one GEMM per fused weight -------------------------------------------------------------------------------------

PACKED = "_packed"  # the attribute a leaf keeps its `Packed` under (not a parameter, buffer or child: never saved)
CALL = "_packed_call"  # ... and what a sharded leaf's packed weight is multiplied with (its parts' style's work)
LEAVES = "_surgery_leaves"  # the attribute a model keeps its leaves under, for `pack_for_inference`


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor; any other tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _global_hooks() -> bool:
    m = nn.modules.module
    return bool(m._global_forward_pre_hooks or m._global_forward_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


def _hook_ids(part: nn.Module) -> tuple:
    return (tuple(part._forward_pre_hooks), tuple(part._forward_hooks))


@dataclass(eq=False)
class Packed:
    """What a leaf multiplies by when its parts are plain Linears whose values `weight` (and `bias`) hold back to back.

    `params` are the parts' `(weight, bias)`, `offsets` where their (local) values start in `weight`'s / `bias`'s
    (local) storage, in elements; `hooks` each part's forward (pre-)hook ids when packed (the parallel style's own,
    whose work `call` does instead: `call(x, weight, bias)`, default `F.linear`).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    params: tuple[tuple[torch.Tensor, torch.Tensor | None], ...]
    offsets: tuple[tuple[int, int | None], ...]
    hooks: tuple[tuple, ...]
    call: Callable | None = None

    def holds(self, parts: list[nn.Module]) -> bool:
        """Whether multiplying by the buffer is what the parts' own forwards would compute now."""
        if len(parts) != len(self.params) or _global_hooks():
            return False
        grad = torch.is_grad_enabled()
        for part, (weight, bias), hooks in zip(parts, self.params, self.hooks):
            if (type(part) is not nn.Linear or "forward" in part.__dict__ or part._backward_hooks
                    or part._backward_pre_hooks or _hook_ids(part) != hooks
                    or part.weight is not weight or part.bias is not bias):
                return False
            if grad and (weight.requires_grad or (bias is not None and bias.requires_grad)):
                return False  # the gradients belong to the parts' own parameters
        if torch.compiler.is_compiling():  # data pointers cannot be traced; the checks above are guarded
            return True
        return self._in_place()

    def _in_place(self) -> bool:
        """The parts' values still lie where they were packed (a `.to()`, a `param.data = ...` moves them)."""
        for (weight, bias), (w_at, b_at) in zip(self.params, self.offsets):
            if not _at(weight, self.weight, w_at) or (bias is not None and not _at(bias, self.bias, b_at)):
                return False
        return True

    def __deepcopy__(self, memo) -> None:
        return None  # a copy's parts get values of their own: its leaves are packed again on their first inference

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.call is not None:
            return self.call(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def _at(part: torch.Tensor, whole: torch.Tensor, offset: int) -> bool:
    part, whole = local(part), local(whole)
    return (part.dtype == whole.dtype and part.device == whole.device
            and part.data_ptr() == whole.data_ptr() + offset * whole.element_size())


def lay_out(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """One new buffer holding `tensors` back to back along `dim`; each tensor's values moved into it: a plain tensor
    becomes a view of it (`.data`), a DTensor's local tensor does (its placements and the object stay)."""
    locals_ = [local(t).detach() for t in tensors]
    whole = torch.cat(locals_, dim=dim)
    start = 0
    for t, piece in zip(tensors, locals_):
        view = whole.narrow(dim, start, piece.shape[dim])
        start += piece.shape[dim]
        if isinstance(t, DTensor):
            t._local_tensor = _alias(view)
        else:
            t.data = view
    return whole


def _alias(view: torch.Tensor) -> torch.Tensor:
    """`view`'s values as a tensor of its own storage object starting where `view` starts (a slice of the buffer's
    storage, which keeps the buffer alive): torch.compile cannot trace a DTensor whose local tensor has a storage
    offset (torch 2.13: "set the storage of a tensor on device cpu to a storage on ... meta")."""
    es = view.element_size()
    storage = view.untyped_storage()[view.storage_offset() * es:]
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(storage, 0, view.shape, view.stride())


def parts_of(leaf: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor | None], int]:
    """A leaf's parts' weights and biases, and the dim along which they make the fused weight (0 rows, 1 columns)."""
    parts = leaf.parts_list()
    if isinstance(leaf, SplitProjection):
        return [p.weight for p in parts], [leaf.attn_part.bias], 1
    return [p.weight for p in parts], [p.bias for p in parts], 0


def pack(leaf: nn.Module, call: Callable | None = None, copy: bool = True) -> bool:
    """Give `leaf` (a `SplitRows` or `SplitProjection` of plain Linears) a `Packed` over its parts' values: a view
    where they already lie back to back (unfused from one fused weight), else, with `copy`, a new buffer they are
    moved into. `call(x, weight, bias)` computes with the buffer (default `F.linear`; a sharded leaf's style's
    work). Returns whether it packed; a leaf whose parts are not plain `nn.Linear`s keeps no `Packed`."""
    leaf.__dict__.pop(PACKED, None)
    parts = leaf.parts_list()
    if any(type(p) is not nn.Linear for p in parts) or any(p.weight.is_meta for p in parts):
        return False
    if any(hasattr(local(p.weight), "__tensor_flatten__") for p in parts):  # quantized: each part dequantizes
        return False
    weights, biases, dim = parts_of(leaf)
    if dim == 0 and len({b is None for b in biases}) > 1:
        return False
    with torch.no_grad():
        weight = _packed(weights, dim, copy)
        bias = None
        if biases[0] is not None:
            bias = biases[0] if dim == 1 else _packed(biases, 0, copy)
        if weight is None or (biases[0] is not None and bias is None):
            return False
        weight = _like(weights[0], weight)
        if dim == 0 and bias is not None:
            bias = _like(biases[0], bias)
    w_base, offsets = local(weight), []
    for w, b in zip(weights, biases if dim == 0 else [biases[0]] + [None] * (len(weights) - 1)):
        w_at = (local(w).data_ptr() - w_base.data_ptr()) // w_base.element_size()
        b_at = None if b is None else (local(b).data_ptr() - local(bias).data_ptr()) // local(bias).element_size()
        offsets.append((w_at, b_at))
    params = tuple((p.weight, p.bias) for p in parts)
    leaf.__dict__[PACKED] = Packed(weight, bias, params, tuple(offsets), tuple(_hook_ids(p) for p in parts), call)
    return True


def _packed(tensors: list[torch.Tensor], dim: int, copy: bool) -> torch.Tensor | None:
    whole = back_to_back([local(t) for t in tensors], dim)
    if whole is None and copy:
        whole = lay_out(tensors, dim)
    return whole


def _like(part: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`whole` (local values) as the parts are held: a DTensor with the first part's mesh and placements (the parts'
    shards laid out back to back are this rank's shard of the packed weight), else a plain tensor."""
    if isinstance(part, DTensor):
        return DTensor.from_local(whole, part.device_mesh, part.placements, run_check=False)
    return whole


def pack_all(model: nn.Module, copy: bool = False) -> int:
    """`pack` every leaf of `model` (unsharded parts only); the number packed."""
    return sum(pack(m, copy=copy) for m in model.modules()
               if isinstance(m, (SplitRows, SplitProjection))
               and not any(isinstance(p, DTensor) for p in m.parameters()))


def unpack_all(model: nn.Module) -> None:
    """Drop every leaf's `Packed` in `model` (the leaves then run their parts' own forwards)."""
    for m in model.modules():
        m.__dict__.pop(PACKED, None)


def unpack(leaf: nn.Module) -> None:
    """Drop `leaf`'s `Packed` and give each part it packed that is a non-contiguous view (a `SplitProjection`'s
    columns) a contiguous copy of its values (the Parameter objects stay)."""
    packed = leaf.__dict__.pop(PACKED, None)
    if packed is None:
        return
    for weight, _ in packed.params:
        values = local(weight)
        if values.is_contiguous():
            continue
        if isinstance(weight, DTensor):
            weight._local_tensor = values.contiguous()
        else:
            weight.data = values.contiguous()


def track_leaves(model: nn.Module) -> None:
    """Keep `model`'s leaves where `pack_for_inference` finds them, and run it before each forward of `model` (once
    registered); neither where `model` holds no leaf."""
    leaves = [m for m in model.modules() if isinstance(m, (SplitRows, SplitProjection))]
    hooked = [key for key, hook in model._forward_pre_hooks.items() if hook is pack_for_inference]
    if not leaves:
        model.__dict__.pop(LEAVES, None)
        for key in hooked:
            del model._forward_pre_hooks[key]
        return
    model.__dict__[LEAVES] = leaves
    if not hooked:
        model.register_forward_pre_hook(pack_for_inference)


@torch.compiler.disable  # moves values: runs before a compiled model's graph, never inside one
def pack_for_inference(model: nn.Module, args: tuple) -> None:
    """A forward pre-hook: on a forward run for inference (`model` in eval mode, autograd off), pack every leaf that
    is not, over a new buffer (the first such forward lays each `SplitProjection`'s columns out: one copy of them; a
    leaf whose parts are wrapped or hooked stays as it is). Costs a dict lookup per leaf once packed."""
    if model.training or torch.is_grad_enabled():
        return
    for leaf in model.__dict__.get(LEAVES, ()):
        if leaf.__dict__.get(PACKED) is None and not leaf.training:
            call = leaf.__dict__.get(CALL)
            if call is not None or not any(isinstance(p, DTensor) for p in leaf.parameters()):
                pack(leaf, call=call, copy=True)


def repacked(leaf: nn.Module, apply, fn, recurse: bool) -> nn.Module:
    """`leaf._apply(fn)` (what `.to()`, `.cuda()`, `.half()` run), then its parts laid out back to back again where it
    was packed: each part's values are moved on their own, and a pipeline moved to its device after `unfuse` would
    otherwise run the parts' own forwards from then on."""
    packed = leaf.__dict__.get(PACKED)
    out = apply(fn, recurse)
    if packed is not None and not any(p.is_meta for p in leaf.parameters()):
        pack(leaf, call=packed.call, copy=True)
    return out
