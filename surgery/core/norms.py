"""`torch.nn.RMSNorm` written as the elementwise ops and the mean that its fused kernel computes.

A q/k norm across heads (`rms_norm_across_heads`: Wan, LTX-Video, LTX-2, SkyReels-V2, ...) reduces over the width
that tensor parallelism splits. Written in these ops, a rank's share of the width as a `Shard(-1)` DTensor gives the
mean as a partial sum that the next op resolves with a small all-reduce (one number per token); `F.rms_norm` on a
DTensor would all-gather the input, or fail on an in-place add. Same parameters, same state dict, the same function
(as torch's kernel computes it: upcast, mean of squares, `rsqrt(... + eps)`, times the weight, cast back; bitwise in
fp32 and bf16).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from surgery.core.leaves import recast


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


def elementwise_norm(child: nn.Module, unfusing: bool) -> nn.Module:
    """A q/k norm child in the other form (`swap_rewrite`'s `children`): `nn.RMSNorm` <-> `ElementwiseRMSNorm`, the
    same parameters; any other module as it is."""
    if unfusing and type(child) is nn.RMSNorm:
        return recast(child, ElementwiseRMSNorm)
    if not unfusing and type(child) is ElementwiseRMSNorm:
        return recast(child, nn.RMSNorm)
    return child
