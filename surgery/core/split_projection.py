"""Leaves that take a fused Linear's place behind the stock call: the stock block and its forward stay diffusers' own.

`SplitProjection` replaces a Linear that reads a concatenation, `proj_out(cat([attn, mlp], -1))` (the single-stream
blocks of FLUX.1, Chroma, HunyuanVideo, ...; FLUX.2's `to_out`): split by columns, the same projection is
`attn_part(attention output) + mlp_part(MLP hidden)` (the bias, whole, on `attn_part`). It still takes the
concatenation and cuts it by the ratio of its parts' widths, `attn_in / (attn_in + mlp_in)` of `x.shape[-1]`: true on
the whole model and on every rank of a column-sharded one (each rank holds the same fraction of both), so the stock
forward runs unchanged. Both parts shard rowwise, leave partial sums, and one all-reduce resolves their sum.

`SplitRows` replaces a Linear whose output rows are several projections (q, k, v; SwiGLU gate and up; FLUX.2's
q, k, v, gate, up): it returns `cat([part(x) for part in parts], -1)`, which is what the fused Linear returns on the
whole model and, column-sharded, each rank's share of every part in the same order, so a stock `chunk(2)` or a
split by the parts' ratio still finds each part.

The children's names are chosen not to collide with the name patterns diffusers' features use: TaylorSeer hooks
every module whose path fully matches `^single_transformer_blocks.*attn` (so no child may end in `attn`), and stock
LoRA `target_modules` such as `to_q`, `to_k`, `to_v` are matched as suffixes (so no child may be called that).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import PrepareModuleOutput, RowwiseParallel

from surgery.core.slicing import Slice, column_slices, row_slices

ATTN_PART, MLP_PART = "attn_part", "mlp_part"


class SplitProjection(nn.Module):
    """What `nn.Linear(attn_features + mlp_features, out_features)(cat([a, m], -1))` computes, as
    `attn_part(a) + mlp_part(m)`; called on the concatenation, like the Linear it replaces."""

    def __init__(self, attn_features: int, mlp_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.attn_part = nn.Linear(attn_features, out_features, bias=bias)
        self.mlp_part = nn.Linear(mlp_features, out_features, bias=False)

    @property
    def in_features(self) -> int:
        return self.attn_part.in_features + self.mlp_part.in_features

    @property
    def out_features(self) -> int:
        return self.attn_part.out_features

    @property
    def has_bias(self) -> bool:
        return self.attn_part.bias is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn, mlp = self.attn_part.in_features, self.mlp_part.in_features
        width = x.shape[-1] * attn // (attn + mlp)  # the attention's share of the (local) concatenation
        return self.attn_part(x[..., :width]) + self.mlp_part(x[..., width:])


# Both parts leave partial sums; the module's output resolves them with one all-reduce (before any gate or residual).
# Families compose it under the leaf's path (`surgery.core.leaves.under("proj_out", SPLIT_PROJECTION_TP_PLAN)`).
SPLIT_PROJECTION_TP_PLAN = {
    ATTN_PART: RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    MLP_PART: RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    "": PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
}


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
        return nn.Linear(split.in_features, split.out_features, bias=split.has_bias)


class SplitRows(nn.Module):
    """What a Linear whose output rows are the named parts, in order, computes: `cat([part(x) ...], -1)`."""

    def __init__(self, in_features: int, parts: list[tuple[str, int]], bias: bool = False):
        super().__init__()
        for name, size in parts:
            self.add_module(name, nn.Linear(in_features, size, bias=bias))

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
