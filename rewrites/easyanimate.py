"""`EasyAnimateTransformer3DModel` (diffusers `transformer_easyanimate.py`): the `easyanimate` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Its class's defaults
do not construct (`in_channels=None`, `patch_size=None`): only a published config builds it.
"""

from __future__ import annotations

import math

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_easyanimate import EasyAnimateTransformer3DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import cast_inputs


def easyanimate_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `EasyAnimateTransformer3DModel.forward`: a video latent of `image_tokens`
    patches (two frames), the Qwen2-VL text, a timestep, and for an inpainting config (more input channels than
    output) the inpaint latents that fill the rest of the input channels."""
    generator = torch.Generator().manual_seed(seed)
    frames = 2
    per_frame = max(1, image_tokens // frames)
    height = max(d for d in range(1, math.isqrt(per_frame) + 1) if per_frame % d == 0)
    width, patch = per_frame // height, config.get("patch_size", 2)
    latent = config.get("out_channels", 16)
    size = (frames, height * patch, width * patch)
    inputs = dict(
        hidden_states=torch.randn(batch, latent, *size, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_embed_dim", 3584),
                                          generator=generator),
    )
    if config.get("in_channels", latent) > latent:
        inputs["inpaint_latents"] = torch.randn(batch, config["in_channels"] - latent, *size, generator=generator)
    return cast_inputs(inputs, dtype, device)


FAMILY = derived_family(
    "easyanimate", EasyAnimateTransformer3DModel, attention=(Attention,),
    variants={
        "v5.1-12b": dict(in_channels=16, out_channels=16, patch_size=2),
        "v5.1-12b-inp": dict(in_channels=33, out_channels=16, patch_size=2),
    },
    sources="alibaba-pai/EasyAnimateV5.1-12b-zh(-InP)-diffusers transformer/config.json: diffusers' "
    "EasyAnimateTransformer3DModel defaults (48 MMDiT blocks of 48 heads x 64, Qwen2-VL text 3584) with the "
    "latent channels (16; 33 with the inpaint latents) and patch size 2 that the defaults leave unset",
    default_variant="v5.1-12b",
    example_inputs=easyanimate_inputs,
    tests=Tests(configs={"tiny": dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
                                      patch_size=2, num_layers=2, mmdit_layers=2, text_embed_dim=16,
                                      time_embed_dim=16, sample_height=16, sample_width=16)}),
)
