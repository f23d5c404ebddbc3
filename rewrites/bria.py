"""Bria 3.x (diffusers `BriaTransformer2DModel`): the single-stream block's fused output projection, and attention
processors that split heads by head size so that they run column-sharded.

| module (diffusers class, kept) | swapped                                                                            |
|--------------------------------|------------------------------------------------------------------------------------|
| `BriaSingleTransformerBlock`   | `proj_out` -> `SplitProjection` (`.attn_part`, `.mlp_part`); `attn`'s processor    |
| `BriaAttention` (double block) | processor `BriaAttnProcessor` -> its head-dim twin (`surgery.core.leaves`)              |

Bria's structure is LongCat-Image's: the rewrites come from `rewrites.longcat_image`. The plans are derived from the
unfused modules (`surgery.extend.derived_family`): heads and MLP hidden units split across ranks; one all-reduce per
single block, one per output projection and feed-forward in the double blocks.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_bria import (
    BriaAttention,
    BriaAttnProcessor,
    BriaSingleTransformerBlock,
    BriaTransformer2DModel,
)

from surgery_rewrites.diffusers_common import flux_like_inputs, flux_like_rewrites, reduced
from surgery.extend import Processors, Tests, derived_family

REWRITES = flux_like_rewrites("bria", BriaSingleTransformerBlock, BriaAttention, Processors((BriaAttnProcessor,)))


# briaai/BRIA-3.2 (T5-XXL text states, FLUX.1-style latents, no guidance embedding). The depth (10 double, 20 single
# blocks) is from memory of the published transformer/config.json and is not verified here; the widths are the class
# defaults.
VARIANTS = {
    "3.2": dict(
        patch_size=1, in_channels=64, num_layers=10, num_single_layers=20, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=None, guidance_embeds=False,
        axes_dims_rope=(16, 56, 56), rope_theta=10000, time_theta=10000,
    ),
}


def example_inputs(config: dict, **kwargs) -> dict:
    """Seeded keyword arguments for `BriaTransformer2DModel.forward` at `config` (no guidance: its forward tests the
    guidance tensor's truth value, which only a one-element tensor has)."""
    return flux_like_inputs(config, **kwargs, in_channels=64, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56))


def _reduced(config: dict, layers: int = 2, single_layers: int = 4, head_dim: int = 32) -> dict:
    """A published config at demo size: same head count; fewer blocks, smaller heads, narrow text states."""
    return dict(reduced(config, layers, single_layers, head_dim), pooled_projection_dim=None)


def _small(**config) -> dict:
    return dict(dict(in_channels=8, joint_attention_dim=24, guidance_embeds=False), **config)


# The first config is what the conformance suite shards (world 2 and 4): heads and MLP width divide by 4.
TEST_CONFIGS = {
    "tp_wide": _small(num_layers=1, num_single_layers=2, num_attention_heads=4, attention_head_dim=8,
                      axes_dims_rope=(2, 2, 4)),
    "odd_heads": _small(num_layers=1, num_single_layers=2, num_attention_heads=3, attention_head_dim=12,
                        axes_dims_rope=(4, 4, 4)),
}

FAMILY = derived_family(
    "bria", BriaTransformer2DModel,
    variants=VARIANTS,
    sources="BriaTransformer2DModel defaults (diffusers 0.42.1) for the widths; briaai/BRIA-3.2 "
    "transformer/config.json for the depth (unverified)",
    default_variant="3.2",
    example_inputs=example_inputs,
    rewrites=REWRITES,
    shrink_config=_reduced,
    tests=Tests(configs=TEST_CONFIGS),
)
