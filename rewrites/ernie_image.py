"""`ErnieImageTransformer2DModel` (diffusers `transformer_ernie_image.py`): the `ernie-image` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). The adaptive norms'
Linears stay whole by the general rule of `surgery.parallel.plans.replicated_reason`.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_ernie_image import (
    ErnieImageAttention,
    ErnieImageSingleStreamAttnProcessor,
    ErnieImageTransformer2DModel,
)

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import cast_inputs


def ernie_image_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `ErnieImageTransformer2DModel.forward`: a square latent of `image_tokens`
    patches, the text features of `text_in_dim` padded to `text_tokens` with each sample's length (the second
    sample two tokens shorter: the padding mask's path runs) and a timestep."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 1)
    lengths = torch.tensor([text_tokens - 2 * (i % 2) for i in range(batch)])
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 128), side, side, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        text_bth=torch.randn(batch, text_tokens, config.get("text_in_dim", 2560), generator=generator),
    )
    return {**cast_inputs(inputs, dtype, device), "text_lens": lengths.to(device)}


_ERNIE_IMAGE = dict(hidden_size=4096, num_attention_heads=32, num_layers=36, ffn_hidden_size=12288, in_channels=128,
                    out_channels=128, patch_size=1, text_in_dim=3072, rope_theta=256, rope_axes_dim=(32, 48, 48),
                    eps=1e-6, qk_layernorm=True)


FAMILY = derived_family(
    "ernie-image", ErnieImageTransformer2DModel, attention=(ErnieImageAttention,),
    processors=(ErnieImageSingleStreamAttnProcessor,),
    variants={"base": _ERNIE_IMAGE, "turbo": _ERNIE_IMAGE},
    sources="baidu/ERNIE-Image and baidu/ERNIE-Image-Turbo transformer/config.json (36 layers, 32 heads of 128, "
    "SwiGLU-like feed-forward of 12288, text 3072; the Turbo config adds LoRA fields the class ignores)",
    default_variant="base",
    example_inputs=ernie_image_inputs,
    tests=Tests(configs={"tiny": dict(hidden_size=32, num_attention_heads=4, num_layers=2, ffn_hidden_size=48,
                                      in_channels=8, out_channels=8, patch_size=1, text_in_dim=16,
                                      rope_axes_dim=(4, 2, 2))}),
)
