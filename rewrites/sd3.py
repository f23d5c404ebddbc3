"""`SD3Transformer2DModel` (diffusers `transformer_sd3.py`): the `sd3` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Its processors reshape
by the stored head count in the older spelling (`head_dim = inner_dim // attn.heads`), which the processor rule of
`surgery.core.leaves` reads.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import GENERIC, cast_inputs


def sd3_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `SD3Transformer2DModel.forward`: a square latent of `image_tokens` patches, text
    of `joint_attention_dim`, a pooled text embedding and a timestep."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), side, side, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("joint_attention_dim", 4096),
                                          generator=generator),
        pooled_projections=torch.randn(batch, config.get("pooled_projection_dim", 2048), generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
    )
    return cast_inputs(inputs, dtype, device)


_SD3 = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=64,
            joint_attention_dim=4096, pooled_projection_dim=2048)


_SD3_TINY = dict(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                 num_attention_heads=4, joint_attention_dim=16, caption_projection_dim=32, pooled_projection_dim=16,
                 pos_embed_max_size=8)


FAMILY = derived_family(
    "sd3", SD3Transformer2DModel, attention=(Attention,), processors=GENERIC,
    variants={
        "sd3-medium": {**_SD3, "num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
                       "pos_embed_max_size": 192},
        "sd3.5-medium": {**_SD3, "num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
                         "pos_embed_max_size": 384, "qk_norm": "rms_norm",
                         "dual_attention_layers": tuple(range(13))},
        "sd3.5-large": {**_SD3, "num_layers": 38, "num_attention_heads": 38, "caption_projection_dim": 2432,
                        "pos_embed_max_size": 192, "qk_norm": "rms_norm"},
    },
    sources="transformer/config.json of stabilityai/stable-diffusion-3-medium-diffusers, "
    "stabilityai/stable-diffusion-3.5-medium and stabilityai/stable-diffusion-3.5-large (the values diffusers "
    "scripts/convert_sd3_to_diffusers.py reads off each checkpoint: heads = layers, caption_projection_dim from "
    "context_embedder, dual-attention layers, rms q/k norm)",
    default_variant="sd3.5-large",
    example_inputs=sd3_inputs,
    tests=Tests(
        # the first test config is the one run sharded: SD3.5's, whose blocks hold SD3's and add q/k norms and a
        # second self-attention
        configs={"tiny_3.5": {**_SD3_TINY, "qk_norm": "rms_norm", "dual_attention_layers": (0,)},
                 "tiny": _SD3_TINY},
    ),
)
