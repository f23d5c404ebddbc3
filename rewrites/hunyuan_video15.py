"""`HunyuanVideo15Transformer3DModel` (diffusers `transformer_hunyuan_video15.py`): the `hunyuan-video-1.5` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). The adaptive norms'
Linears stay whole by the general rule of `surgery.parallel.plans.replicated_reason`.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_hunyuan_video15 import (
    HunyuanVideo15TokenRefiner,
    HunyuanVideo15Transformer3DModel,
)

from surgery.extend import TensorParallel, Tests, derived_family


def hunyuan_video15_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8,
                           seed: int = 0, dtype: torch.dtype = torch.float32,
                           device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `HunyuanVideo15Transformer3DModel.forward`: a one-frame latent of `image_tokens`
    patches, both text streams with their masks (the last two tokens padding), and image embeddings (zero for
    text-to-video, which the model checks)."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 1)
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[:, -2:] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 65), 1, side, side, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_embed_dim", 3584), generator=generator),
        encoder_attention_mask=mask,
        encoder_hidden_states_2=torch.randn(batch, 4, config.get("text_embed_2_dim", 1472), generator=generator),
        encoder_attention_mask_2=torch.ones(batch, 4, dtype=torch.long),
        image_embeds=torch.randn(batch, 4, config.get("image_embed_dim", 1152), generator=generator),
    )
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


FAMILY = derived_family(
    "hunyuan-video-1.5", HunyuanVideo15Transformer3DModel, attention=(Attention,),
    variants={
        "480p-i2v": dict(target_size=640, task_type="i2v"),
        "720p-t2v": dict(target_size=960, task_type="t2v"),
        "720p-i2v": dict(target_size=960, task_type="i2v"),
        "480p-i2v-step-distilled": dict(target_size=640, task_type="i2v", use_meanflow=True),
    },
    sources="diffusers scripts/convert_hunyuan_video1_5_to_diffusers.py (TRANSFORMER_CONFIGS over the class "
    "defaults: 54 layers, 16 heads of 128)",
    default_variant="720p-t2v",
    example_inputs=hunyuan_video15_inputs,
    tp=TensorParallel(replicated={HunyuanVideo15TokenRefiner: {
        "proj_in": "the text states' input projection, ahead of the refiner blocks (text tokens only, small)"}}),
    tests=Tests(configs={"tiny": dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8,
                                      num_layers=2, num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=8,
                                      image_embed_dim=8, rope_axes_dim=(2, 2, 4))}),
)
