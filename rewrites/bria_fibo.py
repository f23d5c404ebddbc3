"""Bria FIBO (diffusers `BriaFiboTransformer2DModel`): the single-stream block's fused output projection, and
attention processors that split heads by head size so that they run column-sharded.

| module (diffusers class, kept)                   | swapped                                                    |
|--------------------------------------------------|------------------------------------------------------------|
| `BriaFiboSingleTransformerBlock`                 | `proj_out` -> `SplitProjection` (`.attn_part`, `.mlp_part`); |
|                                                  | its `attn` (a generic `Attention` running Bria's processor): |
|                                                  | processor -> head-dim twin                                 |
| `BriaFiboAttention` (double block)               | processor `BriaFiboAttnProcessor` -> head-dim twin         |

Only the generic `Attention` modules running `BriaAttnProcessor` are this family's (told apart by their processor).
The plans are LongCat-Image's, derived from the unfused modules (`surgery.extend.derived_family`).
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_bria import BriaAttnProcessor
from diffusers.models.transformers.transformer_bria_fibo import (
    BriaFiboAttention,
    BriaFiboAttnProcessor,
    BriaFiboSingleTransformerBlock,
    BriaFiboTextProjection,
    BriaFiboTransformer2DModel,
)

from surgery_rewrites.diffusers_common import flux_like_inputs, flux_like_rewrites, reduced
from surgery.extend import Processors, TensorParallel, Tests, derived_family, swap_rewrite

_SINGLE_ATTENTION = Processors((BriaAttnProcessor,))
REWRITES = (
    *flux_like_rewrites("bria_fibo", BriaFiboSingleTransformerBlock, BriaFiboAttention,
                        Processors((BriaFiboAttnProcessor,)), single_attention=_SINGLE_ATTENTION),
    # a single block's attention outside its block's rewrite (a stock processor set after unfuse)
    swap_rewrite("bria_fibo.single_block_attention", Attention, processors=_SINGLE_ATTENTION),
)


# briaai/FIBO: SmolLM3-3B text states (2048 wide, one per block through `caption_projection`), Wan2.2 VAE latents
# (48 channels). Depth (8 double, 38 single blocks) and in_channels are from memory of the published
# transformer/config.json, not verified here; the widths are the class defaults.
VARIANTS = {
    "fibo": dict(
        patch_size=1, in_channels=48, num_layers=8, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=None, guidance_embeds=False,
        axes_dims_rope=(16, 56, 56), rope_theta=10000, time_theta=10000, text_encoder_dim=2048,
    ),
}
_DEFAULTS = dict(in_channels=64, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56), text_encoder_dim=2048,
                 num_layers=19, num_single_layers=38)


def example_inputs(config: dict, text_tokens: int = 8, seed: int = 0, **kwargs) -> dict:
    """Seeded keyword arguments for `BriaFiboTransformer2DModel.forward` at `config`: FLUX.1-style inputs plus one
    text-encoder layer's states per block."""
    inputs = flux_like_inputs(config, text_tokens=text_tokens, seed=seed, **kwargs, **_DEFAULTS)
    config = dict(_DEFAULTS, **config)
    generator = torch.Generator().manual_seed(seed + 1)
    batch = inputs["hidden_states"].shape[0]
    shape = (batch, text_tokens, config["text_encoder_dim"])
    blocks = config["num_layers"] + config["num_single_layers"]
    layers = [torch.randn(shape, generator=generator) for _ in range(blocks)]
    like = inputs["encoder_hidden_states"]
    inputs["text_encoder_layers"] = [layer.to(device=like.device, dtype=like.dtype) for layer in layers]
    return inputs


def _reduced(config: dict, layers: int = 2, single_layers: int = 4, head_dim: int = 32) -> dict:
    """A published config at demo size: same head count; fewer blocks, smaller heads, narrow text states."""
    return dict(reduced(config, layers, single_layers, head_dim), pooled_projection_dim=None, text_encoder_dim=32)


def _small(**config) -> dict:
    return dict(dict(in_channels=8, joint_attention_dim=24, text_encoder_dim=12, guidance_embeds=False), **config)


# The first config is what the conformance suite shards (world 2 and 4): heads and MLP width divide by 4.
TEST_CONFIGS = {
    "tp_wide": _small(num_layers=1, num_single_layers=2, num_attention_heads=4, attention_head_dim=8,
                      axes_dims_rope=(2, 2, 4)),
    "odd_heads": _small(num_layers=1, num_single_layers=2, num_attention_heads=3, attention_head_dim=12,
                        axes_dims_rope=(4, 4, 4)),
}

FAMILY = derived_family(
    "bria-fibo", BriaFiboTransformer2DModel,
    variants=VARIANTS,
    sources="BriaFiboTransformer2DModel defaults (diffusers 0.42.1) for the widths; briaai/FIBO "
    "transformer/config.json for depth and in_channels (unverified)",
    default_variant="fibo",
    example_inputs=example_inputs,
    rewrites=REWRITES,
    shrink_config=_reduced,
    tp=TensorParallel(
        # one per block, ahead of the blocks: reads the text states (few tokens) every rank holds whole
        replicated={BriaFiboTextProjection: {
            "linear": "the text states' per-block input projection, ahead of the blocks"}},
    ),
    tests=Tests(configs=TEST_CONFIGS),
)
