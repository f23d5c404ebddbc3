"""`Lumina2Transformer2DModel` (diffusers `transformer_lumina2.py`): the `lumina2` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`).

Lumina2's processor attends with grouped queries (`kv_heads` read off the key width); the processor rule of
`surgery.core.leaves` reads its head counts from the local widths, and the derived head check splits query and
key/value heads alike, so a rank holds whole groups.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_lumina2 import Lumina2Transformer2DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import cast_inputs


def lumina2_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `Lumina2Transformer2DModel.forward`: a square latent of `image_tokens` patches,
    the caption features of `cap_feat_dim` and their mask, padded by one token more per sample (captions of unequal
    length: the joint blocks' mask path)."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    mask = torch.ones(batch, text_tokens, dtype=torch.bool)
    for i in range(batch):
        mask[i, text_tokens - 1 - i:] = False
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), side, side, generator=generator),
        timestep=torch.rand(batch, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("cap_feat_dim", 1024), generator=generator),
        encoder_attention_mask=mask,
    )
    return cast_inputs(inputs, dtype, device)


FAMILY = derived_family(
    "lumina2", Lumina2Transformer2DModel, attention=(Attention,),
    variants={
        "image-2.0": dict(sample_size=128, patch_size=2, in_channels=16, hidden_size=2304, num_layers=26,
                          num_refiner_layers=2, num_attention_heads=24, num_kv_heads=8, multiple_of=256,
                          ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(32, 32, 32),
                          axes_lens=(300, 512, 512), cap_feat_dim=2304),
    },
    sources="transformer/config.json of Alpha-VLLM/Lumina-Image-2.0 (diffusers' Lumina2Transformer2DModel "
    "defaults but cap_feat_dim 2304, its Gemma-2-2B text encoder's width; the original NextDiT 2B GQA: 26 "
    "layers, 24 heads of 96, 8 key/value heads)",
    default_variant="image-2.0",
    example_inputs=lumina2_inputs,
    tests=Tests(
        # 8 query heads in 4 groups of 2: worlds 2 and 4 split both counts
        configs={"tiny": dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=64, num_layers=2,
                              num_refiner_layers=1, num_attention_heads=8, num_kv_heads=4, multiple_of=8,
                              axes_dim_rope=(4, 2, 2), axes_lens=(128, 128, 128), cap_feat_dim=16)},
    ),
)
