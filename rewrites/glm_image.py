"""`GlmImageTransformer2DModel` (diffusers `transformer_glm_image.py`): the `glm-image` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). The adaptive norms'
Linears stay whole by the general rule of `surgery.parallel.plans.replicated_reason`.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_glm_image import GlmImageTransformer2DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import cast_inputs


def glm_image_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `GlmImageTransformer2DModel.forward`: a square latent of `image_tokens` patches,
    the glyph text features of `text_embed_dim` with a padding mask (the last two tokens padding), the
    autoregressive prior's token per patch (none dropped), a timestep and the size conditions."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5)
    p = config.get("patch_size", 2)
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[:, -2:] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), side * p, side * p, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_embed_dim", 1472),
                                          generator=generator),
        prior_token_id=torch.randint(0, config.get("prior_vq_quantizer_codebook_size", 16384),
                                     (batch, side * side), generator=generator),
        prior_token_drop=torch.zeros(batch, dtype=torch.bool),
        timestep=(torch.rand(batch, generator=generator) * 1000).long(),
        target_size=torch.tensor([[side * p * 8.0] * 2] * batch),
        crop_coords=torch.zeros(batch, 2),
    )
    return {**cast_inputs(inputs, dtype, device), "attention_mask": mask.to(device)}


FAMILY = derived_family(
    "glm-image", GlmImageTransformer2DModel, attention=(Attention,),
    variants={"base": {}},
    sources="zai-org/GLM-Image transformer/config.json: the class defaults (30 layers, 64 heads of 40, glyph text "
    "1472, the AR prior's 16384-token codebook; diffusers docs/source/en/api/pipelines/glm_image.md loads it)",
    default_variant="base",
    example_inputs=glm_image_inputs,
    tests=Tests(configs={"tiny": dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                                      num_attention_heads=4, text_embed_dim=32, time_embed_dim=16, condition_dim=8,
                                      prior_vq_quantizer_codebook_size=64)}),
)
