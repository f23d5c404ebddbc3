"""`LatteTransformer3DModel` (diffusers `latte_transformer_3d.py`): the `latte` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Its class's defaults
do not construct (`in_channels=None`, `patch_size=None`): only a published config builds it.
"""

from __future__ import annotations

import math

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.latte_transformer_3d import LatteTransformer3DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import GENERIC, cast_inputs


def latte_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `LatteTransformer3DModel.forward`: a video latent of `image_tokens` patches over
    the config's `video_length` frames (its temporal position table is that long), at least 2 patches a frame, the
    T5 text, a timestep. Its spatial blocks attend within a frame: with one patch a frame their softmax is constant,
    the q/k gradients exactly zero and any error of them rounding noise (the published width's 4 tokens over 16
    frames read 1.5 there)."""
    generator = torch.Generator().manual_seed(seed)
    frames = config.get("video_length", 16)
    per_frame = max(2, image_tokens // frames)
    height = max(d for d in range(1, math.isqrt(per_frame) + 1) if per_frame % d == 0)
    width = per_frame // height
    patch = config.get("patch_size", 2)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 4), frames, height * patch, width * patch,
                                  generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("caption_channels", 4096),
                                          generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
    )
    return {**cast_inputs(inputs, dtype, device), "enable_temporal_attentions": True}


FAMILY = derived_family(
    "latte", LatteTransformer3DModel, attention=(Attention,), processors=GENERIC,
    variants={"1": dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
                        num_layers=28, cross_attention_dim=1152, attention_bias=True, sample_size=64,
                        patch_size=2, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
                        norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
                        caption_channels=4096, video_length=16)},
    sources="maxin-cn/Latte-1 transformer/config.json (Latte-XL/2 for text-to-video: 28 spatial and 28 "
    "temporal blocks of 16 heads x 72, PixArt-alpha's T5 caption projection; diffusers' Latte pipeline docs)",
    default_variant="1",
    example_inputs=latte_inputs,
    tests=Tests(configs={"tiny": dict(num_attention_heads=8, attention_head_dim=4, in_channels=4, out_channels=8,
                                      num_layers=2, cross_attention_dim=32, attention_bias=True, sample_size=8,
                                      patch_size=2, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
                                      norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
                                      caption_channels=16, video_length=2)}),
)
