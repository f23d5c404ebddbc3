"""Norms written as the elementwise ops and means that their fused kernels compute, for norms across heads.

A q/k norm across heads (`rms_norm_across_heads`: Wan, LTX-Video, LTX-2, SkyReels-V2, ...; `layer_norm_across_heads`:
Lumina-Next) reduces over the width that tensor parallelism splits. Written in these ops, a rank's share of the width
as a `Shard(-1)` DTensor gives each mean as a partial sum that the next op resolves with a small all-reduce (one
number per token); `F.rms_norm` / `F.layer_norm` on a DTensor would all-gather the input, or fail. Same parameters,
same state dict, the same function:

- `ElementwiseRMSNorm`, as torch's kernel computes it (upcast, mean of squares, `rsqrt(... + eps)`, times the weight,
  cast back; bitwise in fp32 and bf16): one all-reduce per call;
- `ElementwiseLayerNorm`, two passes as torch's kernel (the mean, then the mean of the centred squares; float32 for
  16-bit inputs): equal to `nn.LayerNorm` to float rounding, not bitwise (torch's kernel accumulates by Welford's
  method); two all-reduces per call, the mean's and the variance's.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from surgery.core.leaves import recast
from surgery.core.registry import Rewrite


class ElementwiseRMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` over its last dimension, computed with elementwise ops and a mean (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            raise ValueError(f"ElementwiseRMSNorm normalizes the last dimension only, not {self.normalized_shape}.")
        upcast = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        eps = self.eps if self.eps is not None else torch.finfo(upcast.dtype).eps
        out = upcast * torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)
        if self.weight is not None:
            out = out * self.weight.to(out.dtype)
        return out.type_as(x)


class ElementwiseLayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` over its last dimension, computed with elementwise ops and two means (see the module docstring)."""

    # the all-reduces a call makes on a rank's share of the width: the mean, then the variance
    statistics = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            raise ValueError(f"ElementwiseLayerNorm normalizes the last dimension only, not {self.normalized_shape}.")
        # a copy to centre in place: an in-place op keeps its tensor's placement, so on a share of the width DTensor
        # resolves the partial mean (one all-reduce of a number per token) instead of gathering the input (what
        # `x - mean` picks, its output taking the mean's partial placement)
        centred = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x.clone()
        centred -= centred.mean(-1, keepdim=True)
        out = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            out = out * self.weight.to(out.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.type_as(x)


ELEMENTWISE = {nn.RMSNorm: ElementwiseRMSNorm, nn.LayerNorm: ElementwiseLayerNorm}
STOCK = {v: k for k, v in ELEMENTWISE.items()}


def elementwise_norm(child: nn.Module, unfusing: bool) -> nn.Module:
    """A q/k norm child in the other form (`swap_rewrite`'s `children`): `nn.RMSNorm` <-> `ElementwiseRMSNorm`, the
    same parameters; any other module as it is."""
    if unfusing and type(child) is nn.RMSNorm:
        return recast(child, ElementwiseRMSNorm)
    if not unfusing and type(child) is ElementwiseRMSNorm:
        return recast(child, nn.RMSNorm)
    return child


def _head_size(attention: nn.Module) -> int:
    heads = next(h for h in (getattr(attention, "heads", None), getattr(attention, "num_heads", None))
                 if isinstance(h, int))
    return attention.to_q.out_features // heads


def norms_across_heads(name: str, cls: type[nn.Module], norms: tuple[str, ...] = ("norm_q", "norm_k")) -> Rewrite:
    """The rewrite of attention modules of `cls` whose q/k norms (`norms`) are torch norms across heads (wider than
    one head, `to_q.out_features // heads`): each becomes its elementwise form (`ElementwiseRMSNorm`,
    `ElementwiseLayerNorm`), which a rank holding a share of the heads computes by its statistics. Per-head norms
    stay as they are; no weight is sliced, so a checkpoint is the same in both layouts."""

    def held(m: nn.Module, classes) -> list[str]:
        return [n for n in norms if type(getattr(m, n, None)) in classes
                and getattr(m, n).normalized_shape[-1] > _head_size(m)]

    def build(m: nn.Module, table: dict) -> nn.Module:
        return recast(m, **{n: recast(getattr(m, n), table[type(getattr(m, n))]) for n in held(m, table)})

    return Rewrite(name=name, fused=cls, unfused=cls, slices=lambda m: [],
                   build_unfused=lambda m: build(m, ELEMENTWISE), build_fused=lambda m: build(m, STOCK),
                   is_fused=lambda m: bool(held(m, ELEMENTWISE)), is_unfused=lambda m: bool(held(m, STOCK)),
                   in_checkpoints=False)
