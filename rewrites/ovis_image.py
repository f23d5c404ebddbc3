"""Ovis-Image (diffusers `OvisImageTransformer2DModel`): the single-stream block's fused gated MLP and output
projection, the double-stream blocks' SwiGLU feed-forwards, and attention processors that split heads by head size.

| module (diffusers)                | unfused                                                                          |
|-----------------------------------|----------------------------------------------------------------------------------|
| `OvisImageSingleTransformerBlock` | `OvisImageSplitSingleTransformerBlock` (a twin: its forward is the stock one   |
|                                   | with one edit, see below); `proj_mlp` -> `SplitRows` (`.up`, `.gate`: views),    |
|                                   | `proj_out` -> `SplitProjection` (`.attn_part`, `.mlp_part`); `attn`'s processor  |
| `FeedForward` with a `SwiGLU`     | `SplitSwiGLUFeedForward`: net.0.proj rows -> `.proj_up`, `.proj_gate`            |
| `OvisImageAttention`              | processor `OvisImageAttnProcessor` -> its head-dim twin (`surgery.core.leaves`)       |

The single block's `proj_mlp` holds two row blocks, `up` then `gate` (`up * silu(gate)`), and the stock forward splits
its output by the global widths (`torch.split(..., [mlp_hidden_dim, mlp_hidden_dim])`), which a rank holding half of
each cannot run: the block's twin (`surgery.core.leaves.twin`, edits listed here with `surgery.core.leaves.register_edits`) halves whatever
width it gets instead. `unfuse` names the twin beside the stock class in the model's `_repeated_blocks` and
`_no_split_modules`, and diffusers' block registry knows it under the stock class's metadata.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.activations import SwiGLU
from diffusers.models.attention import FeedForward
from diffusers.models.transformers.transformer_ovis_image import (
    OvisImageAttention,
    OvisImageAttnProcessor,
    OvisImageSingleTransformerBlock,
    OvisImageTransformer2DModel,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery_rewrites.diffusers_common import (
    DOUBLE_STREAM_ATTENTION_TP_PLAN,
    HEAD_NORM,
    flux_like_inputs,
    flux_like_rewrites,
    reduced,
)
from surgery.core.leaves import recast, twin
from surgery.core.slicing import row_slices
from surgery.extend import Family, Processors, Rewrite, TensorParallel, Tests, register_edits, rows
from surgery.parallel.styles import SPLIT_PROJECTION_TP_PLAN, under

# its gated MLP is split by the global widths: halves of whatever width the rank holds instead
register_edits(OvisImageSingleTransformerBlock, "forward", (
    ("torch.split(\n        self.proj_mlp(norm_hidden_states), [self.mlp_hidden_dim, self.mlp_hidden_dim], dim=-1\n    )",
     "self.proj_mlp(norm_hidden_states).chunk(2, dim=-1)", 1),
))
OvisImageSplitSingleTransformerBlock = twin(
    OvisImageSingleTransformerBlock, "OvisImageSplitSingleTransformerBlock", method="forward"
)

# proj_mlp's rows: up, then gate
PROJ_MLP = rows("proj_mlp", lambda block: [("up", block.mlp_hidden_dim), ("gate", block.mlp_hidden_dim)])


class SplitSwiGLU(nn.Module):
    """diffusers' `SwiGLU` with its fused `proj` as two Linears: `proj_up(x) * silu(proj_gate(x))`."""

    def __init__(self, dim_in: int, dim_out: int, bias: bool = True):
        super().__init__()
        self.proj_up = nn.Linear(dim_in, dim_out, bias=bias)
        self.proj_gate = nn.Linear(dim_in, dim_out, bias=bias)
        self.activation = nn.SiLU()

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.proj_up(hidden_states) * self.activation(self.proj_gate(hidden_states))


class SplitSwiGLUFeedForward(FeedForward):
    """A diffusers `FeedForward` whose `net[0]` is a `SplitSwiGLU`; it runs as the stock one (same forward)."""


# --- slices and builders ----------------------------------------------------------------------------------------------


def _gated_rows(fused: str, up: str, gate: str, hidden: int, bias: bool) -> list:
    parts = [(up, hidden), (gate, hidden)]
    return row_slices(fused, parts, "weight") + (row_slices(fused, parts, "bias") if bias else [])


def _feed_forward_slices(ff: nn.Module) -> list:
    first = ff.net[0]
    fused = isinstance(first, SwiGLU)
    hidden = first.proj.out_features // 2 if fused else first.proj_up.out_features
    bias = (first.proj if fused else first.proj_up).bias is not None
    return _gated_rows("net.0.proj", "net.0.proj_up", "net.0.proj_gate", hidden, bias)


def _split_feed_forward(ff: FeedForward) -> SplitSwiGLUFeedForward:
    proj = ff.net[0].proj
    with torch.device("meta"):
        split = SplitSwiGLU(proj.in_features, proj.out_features // 2, bias=proj.bias is not None)
    split.activation = ff.net[0].activation
    return recast(ff, SplitSwiGLUFeedForward, net=nn.ModuleList([split, *ff.net[1:]]))


def _join_feed_forward(ff: SplitSwiGLUFeedForward) -> FeedForward:
    up = ff.net[0].proj_up
    with torch.device("meta"):
        fused = SwiGLU(up.in_features, up.out_features, bias=up.bias is not None)
    fused.activation = ff.net[0].activation
    return recast(ff, FeedForward, net=nn.ModuleList([fused, *ff.net[1:]]))


REWRITES = (
    *flux_like_rewrites("ovis_image", OvisImageSingleTransformerBlock, OvisImageAttention,
                        Processors((OvisImageAttnProcessor,)), leaves=(PROJ_MLP,),
                        unfused_single_block=OvisImageSplitSingleTransformerBlock),
    # diffusers' FeedForward serves many families; only its SwiGLU form is fused, and among the registered families
    # only Ovis-Image uses it (move this to rewrites/diffusers_common.py once another one does).
    Rewrite(
        name="ovis_image.swiglu_feed_forward",
        fused=FeedForward,
        unfused=SplitSwiGLUFeedForward,
        slices=_feed_forward_slices,
        build_unfused=_split_feed_forward,
        build_fused=_join_feed_forward,
        is_fused=lambda ff: type(ff.net[0]) is SwiGLU,
    ),
)


# --- tensor-parallel plans ------------------------------------------------------------------------------------------

# The single-stream block: FLUX.1's (rewrites/diffusers_common.py) with a SwiGLU proj_mlp. Heads and MLP hidden units
# (up and gate alike) split across ranks; both halves of proj_out leave partial sums that one all-reduce resolves.
SWIGLU_SINGLE_BLOCK_TP_PLAN = {
    "attn.to_q": ColwiseParallel(),
    "attn.to_k": ColwiseParallel(),
    "attn.to_v": ColwiseParallel(),
    "attn.norm_q": HEAD_NORM,
    "attn.norm_k": HEAD_NORM,
    "proj_mlp.up": ColwiseParallel(),
    "proj_mlp.gate": ColwiseParallel(),
    **under("proj_out", SPLIT_PROJECTION_TP_PLAN),
}

# SwiGLU feed-forward: hidden units split across ranks, one all-reduce.
FEED_FORWARD_TP_PLAN = {
    "net.0.proj_up": ColwiseParallel(),
    "net.0.proj_gate": ColwiseParallel(),
    "net.2": RowwiseParallel(),
}

TP_PLANS = {
    OvisImageAttention: DOUBLE_STREAM_ATTENTION_TP_PLAN,
    OvisImageSplitSingleTransformerBlock: SWIGLU_SINGLE_BLOCK_TP_PLAN,
    SplitSwiGLUFeedForward: FEED_FORWARD_TP_PLAN,
}


# --- the family: published configs, example inputs, test configs ----------------------------------------------------

# AIDC-AI/Ovis-Image-7B: the OvisImageTransformer2DModel defaults (6 double / 27 single blocks, 24 heads of 128,
# Ovis2.5-2B text width 2048, rotary axes (16, 56, 56)).
VARIANTS = {
    "7b": dict(
        patch_size=1, in_channels=64, out_channels=64, num_layers=6, num_single_layers=27, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=2048, axes_dims_rope=(16, 56, 56),
    ),
}


def example_inputs(config: dict, **kwargs) -> dict:
    """Seeded keyword arguments for `OvisImageTransformer2DModel.forward` at `config`."""
    return flux_like_inputs(config, **kwargs, in_channels=64, joint_attention_dim=2048, axes_dims_rope=(16, 56, 56))


def _reduced(config: dict, layers: int = 2, single_layers: int = 4, head_dim: int = 32) -> dict:
    """A published config at demo size: same head count; fewer blocks, smaller heads, narrow text states."""
    config = reduced(config, layers, single_layers, head_dim)
    config.pop("pooled_projection_dim")
    return config


def _small(**config) -> dict:
    return dict(dict(in_channels=8, out_channels=8, joint_attention_dim=24), **config)


# The first config is what the conformance suite shards (world 2 and 4): heads and MLP width divide by 4.
TEST_CONFIGS = {
    "tp_wide": _small(num_layers=1, num_single_layers=2, num_attention_heads=4, attention_head_dim=8,
                      axes_dims_rope=(2, 2, 4)),
    "odd_heads": _small(num_layers=1, num_single_layers=3, num_attention_heads=3, attention_head_dim=12,
                        axes_dims_rope=(4, 4, 4)),
}

FAMILY = Family(
    name="ovis-image",
    model_class=OvisImageTransformer2DModel,
    variants=VARIANTS,
    sources="OvisImageTransformer2DModel defaults (diffusers 0.42.1), which AIDC-AI/Ovis-Image-7B "
    "transformer/config.json uses",
    default_variant="7b",
    example_inputs=example_inputs,
    rewrites=REWRITES,
    shrink_config=_reduced,
    tp=TensorParallel(
        plans=TP_PLANS,
        # per double block: attention out + added out + ff + ff_context; per single block: one
        all_reduces=lambda config: 4 * config["num_layers"] + config["num_single_layers"],
    ),
    tests=Tests(configs=TEST_CONFIGS),
)
