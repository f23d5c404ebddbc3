"""`HeliosTransformer3DModel` (diffusers `transformer_helios.py`): the `helios` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_helios import HeliosAttention, HeliosTransformer3DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import video_grid


def helios_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `HeliosTransformer3DModel.forward`: a video latent of `image_tokens` patches and,
    as Helios' autoregressive sampler passes them, its three histories (one short frame at full resolution, one mid
    frame and four long frames, which the model patches 2x and 4x coarser) with the frame indices of each; the text."""
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = video_grid(image_tokens)
    p_t, p_h, p_w = config.get("patch_size", (1, 2, 2))
    channels = config.get("in_channels", 16)
    size = (height * p_h, width * p_w)

    def latent(count: int) -> torch.Tensor:
        return torch.randn(batch, channels, count * p_t, *size, generator=generator)

    def indices(start: int, count: int) -> torch.Tensor:
        return torch.arange(start, start + count).unsqueeze(0).expand(batch, -1)

    inputs = dict(
        hidden_states=latent(frames),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_dim", 4096), generator=generator),
        latents_history_long=latent(4), indices_latents_history_long=indices(0, 4),
        latents_history_mid=latent(1), indices_latents_history_mid=indices(4, 1),
        latents_history_short=latent(1), indices_latents_history_short=indices(5, 1),
        indices_hidden_states=indices(6, frames),
    )
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


FAMILY = derived_family(
    "helios", HeliosTransformer3DModel, attention=(HeliosAttention,),
    variants={
        "14b": dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
                    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_dim=(44, 42, 42),
                    rope_theta=10000.0, guidance_cross_attn=True, zero_history_timestep=True,
                    has_multi_term_memory_patch=True, is_amplify_history=False),
    },
    sources="diffusers HeliosTransformer3DModel's defaults, the 14B transformer of BestWishYsh/Helios-Base, -Mid "
    "and -Distilled (docs/source/en/api/models/helios_transformer3d.md; FastVideo's Helios tests check the "
    "Helios-Distilled transformer/config.json against these numbers, is_amplify_history off)",
    default_variant="14b",
    example_inputs=helios_inputs,
    tests=Tests(configs={"tiny": dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
                                      text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_dim=(2, 2, 4))}),
)
