"""`AllegroTransformer3DModel` (diffusers `transformer_allegro.py`): the `allegro` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). The adaptive norms'
Linears stay whole by the general rule of `surgery.parallel.plans.replicated_reason`.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import AllegroAttnProcessor2_0, Attention
from diffusers.models.transformers.transformer_allegro import AllegroTransformer3DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import cast_inputs


def allegro_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `AllegroTransformer3DModel.forward`: two latent frames of `image_tokens / 2`
    patches, the T5 text of `caption_channels` with its padding mask (the last two tokens padding: the cross
    attention's mask path runs) and a timestep. No rotary tables: the pipeline computes them; the processor applies
    them per head, after its head split."""
    generator = torch.Generator().manual_seed(seed)
    p = config.get("patch_size", 2)
    height = max(d for d in range(1, int((image_tokens // 2) ** 0.5) + 1) if (image_tokens // 2) % d == 0)
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[:, -2:] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 4), 2, height * p, image_tokens // 2 // height * p,
                                  generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("caption_channels", 4096),
                                          generator=generator),
        timestep=(torch.rand(batch, generator=generator) * 1000).long(),
    )
    return {**cast_inputs(inputs, dtype, device), "encoder_attention_mask": mask.to(device)}


FAMILY = derived_family(
    "allegro", AllegroTransformer3DModel, attention=(Attention,), processors=(AllegroAttnProcessor2_0,),
    variants={"t2v": {}},
    sources="rhymes-ai/Allegro transformer/config.json: the class defaults (32 layers, 24 heads of 96, cross "
    "attention 2304 over T5-XXL's 4096; diffusers docs/source/en/api/models/allegro_transformer3d.md loads it)",
    default_variant="t2v",
    example_inputs=allegro_inputs,
    tests=Tests(
        # heads x head size a multiple of 16 (its 3D sin-cos positional embedding)
        configs={"tiny": dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
                              num_layers=2, cross_attention_dim=32, sample_width=8, sample_height=8,
                              sample_frames=8, caption_channels=16)},
    ),
)
