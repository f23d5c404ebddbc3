"""LongCat-Image (diffusers `LongCatImageTransformer2DModel`): the single-stream block's fused output projection, and
attention processors that split heads by head size so that they run column-sharded.

| module (diffusers class, kept)       | swapped                                                                  |
|--------------------------------------|--------------------------------------------------------------------------|
| `LongCatImageSingleTransformerBlock` | `proj_out` -> `SplitProjection` (cols -> `.attn_part` with the bias,     |
|                                      | `.mlp_part`); its `attn`'s processor -> head-dim twin                    |
| `LongCatImageAttention`              | processor `LongCatImageAttnProcessor` -> its head-dim twin               |

diffusers' `LongCatImageAttnProcessor` reshapes with the stored head count (`unflatten(-1, (attn.heads, -1))`), wrong
on a rank that holds `heads / N` of them. `surgery.core.leaves.head_dim_twin` builds its twin from the stock source with
that one edit (heads split by `head_dim`); blocks, forwards and attention classes stay diffusers' own. Ovis-Image,
Bria and Bria-Fibo have the same structure: their files reuse `flux_like_rewrites` (rewrites/diffusers_common.py). The plans are derived from the
unfused modules (`surgery.extend.derived_family`): the double block's attention's heads split across ranks, one
all-reduce per output projection; the single block's heads and MLP hidden units split, both parts of `proj_out`
leaving partial sums that one all-reduce resolves.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_longcat_image import (
    LongCatImageAttention,
    LongCatImageAttnProcessor,
    LongCatImageSingleTransformerBlock,
    LongCatImageTransformer2DModel,
)

from surgery.extend import Processors, Tests, derived_family
from surgery_rewrites.diffusers_common import flux_like_inputs, flux_like_rewrites, reduced


PROCESSORS = Processors((LongCatImageAttnProcessor,))
REWRITES = flux_like_rewrites("longcat_image", LongCatImageSingleTransformerBlock, LongCatImageAttention, PROCESSORS)


# --- the family: published configs, example inputs, test configs ----------------------------------------------------

# meituan-longcat/LongCat-Image and LongCat-Image-Edit share one transformer config, equal to the class defaults
# (19 double / 38 single blocks, 24 heads of 128, Qwen2.5-VL-7B text width 3584, rotary axes (16, 56, 56)).
VARIANTS = {
    "base": dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=3584, pooled_projection_dim=3584, axes_dims_rope=(16, 56, 56),
    ),
}


def example_inputs(config: dict, **kwargs) -> dict:
    """Seeded keyword arguments for `LongCatImageTransformer2DModel.forward` at `config`."""
    return flux_like_inputs(config, **kwargs, in_channels=64, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))


def _small(**config) -> dict:
    return dict(dict(in_channels=8, joint_attention_dim=24, pooled_projection_dim=24), **config)


# The first config is what the conformance suite shards (world 2 and 4): heads and MLP width divide by 4.
TEST_CONFIGS = {
    "tp_wide": _small(num_layers=1, num_single_layers=2, num_attention_heads=4, attention_head_dim=8,
                      axes_dims_rope=(2, 2, 4)),
    # 24 heads -> 3, two single blocks per double block as published
    "odd_heads": _small(num_layers=1, num_single_layers=2, num_attention_heads=3, attention_head_dim=12,
                        axes_dims_rope=(4, 4, 4)),
}

FAMILY = derived_family(
    "longcat-image", LongCatImageTransformer2DModel,
    variants=VARIANTS,
    sources="LongCatImageTransformer2DModel defaults (diffusers 0.42.1), which meituan-longcat/LongCat-Image and "
    "LongCat-Image-Edit transformer/config.json use",
    default_variant="base",
    example_inputs=example_inputs,
    rewrites=REWRITES,
    shrink_config=reduced,
    tests=Tests(configs=TEST_CONFIGS),
)
