"""`SanaVideoTransformer3DModel` (diffusers `transformer_sana_video.py`): the `sana-video` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Its linear attention
and its Conv2d feed-forward (GLUMBTempConv) are Sana's: rewrites/sana.py says how they shard.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_sana_video import GLUMBTempConv, SanaVideoTransformer3DModel

from surgery.extend import TensorParallel, Tests, derived_family
from surgery_rewrites.diffusers_common import CONV_FEED_FORWARD, cast_inputs, sana_conditions


def sana_video_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                      dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `SanaVideoTransformer3DModel.forward`: a latent video of `image_tokens` patches
    (frames of 2 x 2 patches; its temporal conv mixes them) plus `sana_conditions`."""
    generator = torch.Generator().manual_seed(seed)
    p_t, p_h, p_w = config.get("patch_size", (1, 2, 2))
    frames = max(1, image_tokens // 4)
    latent = torch.randn(batch, config.get("in_channels", 16), frames * p_t, 2 * p_h, 2 * p_w, generator=generator)
    conditions = sana_conditions(config, batch, text_tokens, generator)
    return cast_inputs(dict(hidden_states=latent, **conditions), dtype, device)


# diffusers scripts/convert_sana_video_to_diffusers.py: transformer_kwargs (480p: the Wan VAE, 720p: DC-AE-V)
_SANA_VIDEO = dict(num_attention_heads=20, attention_head_dim=112, num_layers=20, num_cross_attention_heads=20,
                   cross_attention_head_dim=112, cross_attention_dim=2240, caption_channels=2304, mlp_ratio=3.0,
                   attention_bias=False, norm_elementwise_affine=False, norm_eps=1e-6,
                   qk_norm="rms_norm_across_heads", rope_max_seq_len=1024)


FAMILY = derived_family(
    "sana-video", SanaVideoTransformer3DModel, attention=(Attention,),
    variants={
        "2b-480p": {**_SANA_VIDEO, "sample_size": 30, "patch_size": (1, 2, 2), "in_channels": 16,
                    "out_channels": 16},
        "2b-720p": {**_SANA_VIDEO, "sample_size": 22, "patch_size": (1, 1, 1), "in_channels": 32,
                    "out_channels": 32},
    },
    sources="diffusers scripts/convert_sana_video_to_diffusers.py (SanaVideo: transformer_kwargs; 480p with the "
    "Wan VAE, 720p with DC-AE-V)",
    default_variant="2b-480p",
    example_inputs=sana_video_inputs,
    tp=TensorParallel(replicated={GLUMBTempConv: {"conv_*": CONV_FEED_FORWARD + " (its temporal conv too)"}}),
    tests=Tests(
        # heads of 24 and one block, for the reasons of _SANA_TINY's
        configs={"tiny": dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=24,
                              num_cross_attention_heads=4, cross_attention_head_dim=24, cross_attention_dim=96,
                              caption_channels=16, num_layers=1, sample_size=4, mlp_ratio=2.5,
                              rope_max_seq_len=32)},
    ),
)
