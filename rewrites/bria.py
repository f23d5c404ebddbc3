"""Bria 3.x (diffusers `BriaTransformer2DModel`): the single-stream block's fused output projection, and attention
processors that split heads by head size so that they run column-sharded.

| module (diffusers class, kept) | swapped                                                                            |
|--------------------------------|------------------------------------------------------------------------------------|
| `BriaSingleTransformerBlock`   | `proj_out` -> `SplitProjection` (`.attn_part`, `.mlp_part`); `attn`'s processor    |
| `BriaAttention` (double block) | processor `BriaAttnProcessor` -> its head-dim twin (`surgery.core.leaves`)              |

Bria's structure is LongCat-Image's: the rewrites come from `rewrites.longcat_image`, the plans are the shared ones
of `rewrites.diffusers_common`.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_bria import (
    BriaAttention,
    BriaAttnProcessor,
    BriaSingleTransformerBlock,
    BriaTransformer2DModel,
)

from surgery_rewrites.diffusers_common import DOUBLE_STREAM_ATTENTION_TP_PLAN, SINGLE_BLOCK_TP_PLAN
from surgery_rewrites.longcat_image import flux_like_inputs, flux_like_rewrites, reduced
from surgery.extend import Family, Processors

REWRITES = flux_like_rewrites("bria", BriaSingleTransformerBlock, BriaAttention, Processors((BriaAttnProcessor,)))

# The same plans as LongCat-Image's (same submodules): heads and MLP hidden units split across ranks; one all-reduce
# per single block, one per output projection and feed-forward in the double blocks.
TP_PLANS = {
    BriaAttention: DOUBLE_STREAM_ATTENTION_TP_PLAN,
    BriaSingleTransformerBlock: SINGLE_BLOCK_TP_PLAN,
}


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

FAMILY = Family(
    name="bria",
    model_class=BriaTransformer2DModel,
    variants=VARIANTS,
    sources="BriaTransformer2DModel defaults (diffusers 0.42.1) for the widths; briaai/BRIA-3.2 "
    "transformer/config.json for the depth (unverified)",
    default_variant="3.2",
    example_inputs=example_inputs,
    rewrites=REWRITES,
    tp_plans=TP_PLANS,
    # per double block: attention out + added out + ff + ff_context; per single block: one
    count_all_reduces=lambda config: 4 * config["num_layers"] + config["num_single_layers"],
    test_configs=TEST_CONFIGS,
    shrink_config=_reduced,
)
