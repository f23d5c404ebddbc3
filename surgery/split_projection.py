"""The unfused form of an output projection that reads a concatenation: `Linear(cat([attn, mlp], -1))`.

Single-stream blocks of many DiTs (FLUX.1, Chroma, HunyuanVideo, ...) project `cat([attention output, MLP hidden])`
with one Linear. Column-sharding that concatenated input cuts across attention and MLP. Split by columns, the same
projection is `attn(attention output) + mlp(MLP hidden)` (the bias, whole, on `attn`): two Linears whose inputs are
each column-sharded already, so both shard rowwise, leave partial sums, and one all-reduce resolves their sum.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import PrepareModuleOutput, RowwiseParallel

from .slicing import Slice, column_slices


class SplitProjection(nn.Module):
    """`attn(a) + mlp(m)`: what `nn.Linear(attn_features + mlp_features, out_features)(cat([a, m], -1))` computes."""

    def __init__(self, attn_features: int, mlp_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.attn = nn.Linear(attn_features, out_features, bias=bias)
        self.mlp = nn.Linear(mlp_features, out_features, bias=False)

    def forward(self, attn: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
        return self.attn(attn) + self.mlp(mlp)


# Both halves leave partial sums; the module's output resolves them with one all-reduce (before any gate or residual).
SPLIT_PROJECTION_TP_PLAN = {
    "attn": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    "mlp": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    "": PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
}


def split_projection_slices(name: str, module: nn.Module, attn_features: int | None = None) -> list[Slice]:
    """The slices between a fused `nn.Linear` called `name` and its `SplitProjection` (`name.attn`, `name.mlp`):
    input columns, attention first, the bias whole on `attn`. `module` is either form; for the fused `nn.Linear`,
    `attn_features` says how many of its input columns read the attention output."""
    if isinstance(module, SplitProjection):
        attn, mlp = module.attn.in_features, module.mlp.in_features
        out, bias = module.attn.out_features, module.attn.bias is not None
    else:
        attn, mlp = attn_features, module.in_features - attn_features
        out, bias = module.out_features, module.bias is not None
    return column_slices(name, [(f"{name}.attn", attn), (f"{name}.mlp", mlp)], f"{name}.attn" if bias else None, out)


def split_projection_like(linear: nn.Linear, attn_features: int) -> SplitProjection:
    """An empty `SplitProjection` (on meta) with the shapes of fused `linear`, attention first."""
    with torch.device("meta"):
        return SplitProjection(
            attn_features, linear.in_features - attn_features, linear.out_features, linear.bias is not None
        )


def fused_linear_like(split: SplitProjection) -> nn.Linear:
    """An empty fused `nn.Linear` (on meta) with the shapes of `split`."""
    with torch.device("meta"):
        return nn.Linear(
            split.attn.in_features + split.mlp.in_features, split.attn.out_features, bias=split.attn.bias is not None
        )
