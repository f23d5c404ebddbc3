"""`WanAnimateTransformer3DModel` (diffusers `transformer_wan_animate.py`): the `wan-animate` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers import transformer_wan_animate as animate

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import WAN, WAN_TINY, wan_inputs


def wan_animate_inputs(config: dict, batch: int = 1, image_tokens: int = 16, seed: int = 0,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", **kwargs) -> dict:
    """`wan_inputs` (the video latent with its reference-image channels, the CLIP image tokens, the text) plus what
    WanAnimate's forward adds: the pose latents (one frame fewer than the video, the reference frame having none)
    and the face video in pixels at the motion encoder's resolution, `4 (frames - 1) - 3` frames long (77 for 21
    latent frames, as the pipeline passes it), so that the face encoder's two stride-2 convolutions and its leading
    pad frame give one motion token per latent frame (the face adapters attend per frame)."""
    inputs = wan_inputs(config, batch=batch, image_tokens=image_tokens, seed=seed, dtype=dtype, device=device,
                        **kwargs)
    generator = torch.Generator().manual_seed(seed + 1)
    video = inputs["hidden_states"]
    latent = config.get("latent_channels", (config.get("in_channels", 36) - 4) // 2)
    frames = video.shape[2]
    size = config.get("motion_encoder_size", 512)
    extra = dict(
        pose_hidden_states=torch.randn(batch, latent, frames - 1, *video.shape[3:], generator=generator),
        face_pixel_values=torch.randn(batch, 3, max(1, 4 * (frames - 1) - 3), size, size, generator=generator),
    )
    return {**inputs, **{k: v.to(device=device, dtype=dtype) for k, v in extra.items()}}


# its face adapters (a cross attention to the motion tokens after every fifth block) derive like any attention;
# the motion encoder (a StyleGAN-like conv net with MotionLinear layers, 512 wide) and the face encoder (Conv1d
# layers, one Linear to the model width) read the face video once per forward ahead of the blocks, whole on
# every rank like the other embedders
FAMILY = derived_family(
    "wan-animate", animate.WanAnimateTransformer3DModel,
    attention=(animate.WanAttention, animate.WanAnimateFaceBlockCrossAttention),
    variants={
        "14b": {**WAN, "ffn_dim": 13824, "in_channels": 36, "num_attention_heads": 40, "num_layers": 40,
                "image_dim": 1280, "added_kv_proj_dim": 5120, "rope_max_seq_len": 1024,
                "pos_embed_seq_len": None, "motion_encoder_size": 512, "motion_style_dim": 512,
                "motion_dim": 20, "motion_encoder_dim": 512, "face_encoder_hidden_dim": 1024,
                "face_encoder_num_heads": 4, "inject_face_latents_blocks": 5},
    },
    sources="diffusers scripts/convert_wan_to_diffusers.py (get_transformer_config: Wan2.2-Animate-14B)",
    default_variant="14b",
    example_inputs=wan_animate_inputs,
    tests=Tests(configs={"tiny": {**WAN_TINY, "in_channels": 12, "latent_channels": 4, "image_dim": 8,
                                  "added_kv_proj_dim": 32, "motion_encoder_size": 16,
                                  "motion_encoder_channel_sizes": {"4": 8, "8": 8, "16": 8}, "motion_style_dim": 8,
                                  "motion_dim": 4, "motion_encoder_dim": 8, "face_encoder_hidden_dim": 8,
                                  "face_encoder_num_heads": 2, "inject_face_latents_blocks": 1}}),
)
