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
Bria and Bria-Fibo have the same structure: their files reuse `flux_like_rewrites`. The plans are derived from the
unfused modules (`surgery.extend.derived_family`): the double block's attention's heads split across ranks, one
all-reduce per output projection; the single block's heads and MLP hidden units split, both parts of `proj_out`
leaving partial sums that one all-reduce resolves.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_longcat_image import (
    LongCatImageAttention,
    LongCatImageAttnProcessor,
    LongCatImageSingleTransformerBlock,
    LongCatImageTransformer2DModel,
)

from surgery.extend import Leaf, Processors, Rewrite, SurgeryError, columns, derived_family, swap_rewrite

# The single block's proj_out reads cat([attention output, MLP hidden]): its first columns are the attention's.
PROJ_OUT = columns("proj_out", lambda block: block.attn.inner_dim)


def flux_like_rewrites(
    prefix: str,
    single_block: type[nn.Module],
    attention: type[nn.Module],
    processors: Processors,
    single_attention: Processors | None = None,
    leaves: tuple[Leaf, ...] = (),
    children: dict | None = None,
    unfused_single_block: type[nn.Module] | None = None,
) -> tuple[Rewrite, ...]:
    """A FLUX-like family's rewrites: the single block's `proj_out` (and any other `leaves`) swapped, its `attn`'s
    processor (`single_attention`, default `processors`) swapped for the head-dim twin, and the double blocks'
    `attention` modules' processors likewise."""
    single_attention = single_attention or processors
    return (
        swap_rewrite(f"{prefix}.single_block", single_block, leaves=(*leaves, PROJ_OUT),
                     children={"attn": single_attention, **(children or {})}, unfused_class=unfused_single_block),
        swap_rewrite(f"{prefix}.attention", attention, processors=processors),
    )


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


def flux_like_inputs(
    config: dict,
    batch: int = 1,
    image_tokens: int = 16,
    text_tokens: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **defaults,
) -> dict:
    """Seeded FLUX.1-style keyword arguments (packed latents, text states, timestep in [0, 1), position ids of
    3 axes) for a model at `config`, with `defaults` for sizes the config leaves out."""
    config = dict(defaults, **config)
    generator = torch.Generator().manual_seed(seed)
    axes = len(config["axes_dims_rope"])
    inputs = dict(
        hidden_states=torch.randn(batch, image_tokens, config["in_channels"], generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config["joint_attention_dim"], generator=generator),
        timestep=torch.rand(batch, generator=generator),
        img_ids=torch.randint(0, 64, (image_tokens, axes), generator=generator),
        txt_ids=torch.randint(0, 64, (text_tokens, axes), generator=generator),
    )
    floating = {"hidden_states", "encoder_hidden_states", "timestep"}
    return {k: v.to(device=device, dtype=dtype if k in floating else v.dtype) for k, v in inputs.items()}


def example_inputs(config: dict, **kwargs) -> dict:
    """Seeded keyword arguments for `LongCatImageTransformer2DModel.forward` at `config`."""
    return flux_like_inputs(config, **kwargs, in_channels=64, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))


def balanced_rope_axes(head_dim: int, axes: int = 3) -> tuple[int, ...]:
    """Even rotary sizes summing to `head_dim`, the larger ones last (as in the published (16, 56, 56))."""
    if head_dim % 2 or head_dim < 2 * axes:
        raise SurgeryError(f"head_dim {head_dim} cannot be split into {axes} rotary axes of even size")
    pairs = head_dim // 2
    return tuple(2 * (pairs // axes + (i >= axes - pairs % axes)) for i in range(axes))


def reduced(config: dict, layers: int = 2, single_layers: int = 4, head_dim: int = 32) -> dict:
    """A published config at demo size: same head count; fewer blocks, smaller heads, narrow text states."""
    return dict(config, num_layers=layers, num_single_layers=single_layers, attention_head_dim=head_dim,
                axes_dims_rope=balanced_rope_axes(head_dim), joint_attention_dim=64, pooled_projection_dim=64)


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
    test_configs=TEST_CONFIGS,
    shrink_config=reduced,
)
