"""`AuraFlowTransformer2DModel` (diffusers `auraflow_transformer_2d.py`): the `auraflow` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). The adaptive norms'
Linears stay whole by the general rule of `surgery.parallel.plans.replicated_reason`.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention, AuraFlowAttnProcessor2_0, FusedAuraFlowAttnProcessor2_0
from diffusers.models.transformers.auraflow_transformer_2d import AuraFlowTransformer2DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import cast_inputs


def auraflow_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `AuraFlowTransformer2DModel.forward`: a square latent of `image_tokens` patches,
    the UMT5 text of `joint_attention_dim` and a timestep."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 4), side, side, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("joint_attention_dim", 2048),
                                          generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
    )
    return cast_inputs(inputs, dtype, device)


FAMILY = derived_family(
    "auraflow", AuraFlowTransformer2DModel, attention=(Attention,),
    processors=(AuraFlowAttnProcessor2_0, FusedAuraFlowAttnProcessor2_0),
    variants={
        # 4 joint (MMDiT) blocks, 32 single ones, 12 heads of 256, UMT5-XL text (2048): the class defaults
        "v0.1": {},
        "v0.3": {"pos_embed_max_size": 9216},
    },
    sources="transformer/config.json of fal/AuraFlow (v0.1, the class defaults; diffusers scripts/"
    "convert_aura_flow_to_diffusers.py builds AuraFlowTransformer2DModel(num_mmdit_layers=4, "
    "num_single_dit_layers=32) over them) and fal/AuraFlow-v0.3 (the same with pos_embed_max_size 9216 for its "
    "aspect ratios, as p1atdev/vision-ft's DEFAULT_DENOISER_CONFIG reads it)",
    default_variant="v0.3",
    example_inputs=auraflow_inputs,
    tests=Tests(configs={"tiny": dict(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1,
                                      num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=4,
                                      caption_projection_dim=32, joint_attention_dim=16, out_channels=4,
                                      pos_embed_max_size=16)}),
)
