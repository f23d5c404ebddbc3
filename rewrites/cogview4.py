"""`CogView4Transformer2DModel` (diffusers `transformer_cogview4.py`): the `cogview4` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). The adaptive norms'
Linears stay whole by the general rule of `surgery.parallel.plans.replicated_reason`.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_cogview4 import CogView4Transformer2DModel

from surgery.extend import Tests, derived_family


def cogview4_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `CogView4Transformer2DModel.forward`: a square latent of `image_tokens` patches,
    the text, and the three SDXL-like size conditions."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), side, side, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_embed_dim", 4096), generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        original_size=torch.tensor([[1024.0, 1024.0]] * batch),
        target_size=torch.tensor([[1024.0, 1024.0]] * batch),
        crop_coords=torch.tensor([[0.0, 0.0]] * batch),
    )
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


FAMILY = derived_family(
    "cogview4", CogView4Transformer2DModel, attention=(Attention,),
    variants={
        "6b": dict(patch_size=2, in_channels=16, num_layers=28, attention_head_dim=128, num_attention_heads=32,
                   out_channels=16, text_embed_dim=4096, time_embed_dim=512, condition_dim=256,
                   pos_embed_max_size=128),
    },
    sources="diffusers scripts/convert_cogview4_to_diffusers.py (CogView4-6B)",
    default_variant="6b",
    example_inputs=cogview4_inputs,
    tests=Tests(configs={"tiny": dict(num_layers=2, attention_head_dim=8, num_attention_heads=4, in_channels=4,
                                      out_channels=4, text_embed_dim=16, time_embed_dim=16, condition_dim=8,
                                      pos_embed_max_size=16, sample_size=16, rope_axes_dim=(4, 4))}),
)
