"""`HunyuanVideoFramepackTransformer3DModel` (diffusers `transformer_hunyuan_video_framepack.py`): the `hunyuan-video-framepack` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). The adaptive norms'
Linears stay whole by the general rule of `surgery.parallel.plans.replicated_reason`.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_hunyuan_video_framepack import (
    FramepackClipVisionProjection,
    HunyuanVideoFramepackTransformer3DModel,
)

from surgery.extend import TensorParallel, Tests, derived_family
from surgery_rewrites.hunyuan_video import REWRITES as HUNYUAN_VIDEO_REWRITES, example_inputs as hunyuan_video_inputs


def framepack_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """HunyuanVideo's inputs (`surgery_rewrites.hunyuan_video.example_inputs`) plus what FramePack's sampler adds:
    the SigLIP image embedding (where the config projects one), the frame index of each latent frame and its
    three histories (clean latents at full resolution, 2x and 4x coarser ones, which its history embedder patches
    with 2x and 4x larger kernels) with their frame indices."""
    inputs = hunyuan_video_inputs(config, batch=batch, image_tokens=image_tokens, text_tokens=text_tokens, seed=seed,
                                  dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(seed + 1)
    video = inputs["hidden_states"]
    frames, size = video.shape[2], video.shape[3:]

    def latent(count: int) -> torch.Tensor:
        return torch.randn(batch, video.shape[1], count, *size, generator=generator).to(device, dtype)

    extra = dict(indices_latents=torch.arange(2, 2 + frames))
    if config.get("has_image_proj"):
        extra["image_embeds"] = torch.randn(batch, 4, config.get("image_proj_dim", 1152),
                                            generator=generator).to(device, dtype)
    if config.get("has_clean_x_embedder"):
        extra |= dict(latents_clean=latent(1), indices_latents_clean=torch.arange(1),
                      latents_history_2x=latent(2), indices_latents_history_2x=torch.arange(2, 4) + frames,
                      latents_history_4x=latent(4), indices_latents_history_4x=torch.arange(4, 8) + frames)
    return {**inputs, **{k: v.to(device) for k, v in extra.items()}}


# its blocks are HunyuanVideo's: the hunyuan-video family's rewrites and plans (surgery_rewrites.hunyuan_video)
# apply to them as they are
FAMILY = derived_family(
    "hunyuan-video-framepack", HunyuanVideoFramepackTransformer3DModel, rewrites=HUNYUAN_VIDEO_REWRITES,
    variants={
        "i2v": dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                    num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                    qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                    rope_theta=256.0, rope_axes_dim=(16, 56, 56), image_condition_type=None,
                    has_image_proj=True, image_proj_dim=1152, has_clean_x_embedder=True),
    },
    sources="lllyasviel/FramePackI2V_HY transformer/config.json (diffusers' FramePack docs load it into "
    "HunyuanVideoFramepackTransformer3DModel: HunyuanVideo's 20 + 40 blocks of 24 heads of 128, the SigLIP "
    "image projection of 1152 and the history embedder)",
    default_variant="i2v",
    example_inputs=framepack_inputs,
    tp=TensorParallel(replicated={FramepackClipVisionProjection: dict.fromkeys(
        ("up", "down"), "the SigLIP image embedding's projection ahead of the blocks (a few image tokens)")}),
    tests=Tests(configs={"tiny": dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8,
                                      num_layers=1, num_single_layers=1, num_refiner_layers=1, text_embed_dim=16,
                                      pooled_projection_dim=8, rope_axes_dim=(2, 2, 4), has_image_proj=True,
                                      image_proj_dim=16, has_clean_x_embedder=True)}),
)
