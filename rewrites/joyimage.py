"""JoyImage-Edit (diffusers `transformer_joyimage.py`): double-stream blocks whose joint attention holds each stream's
q/k/v fused in one Linear (`img_attn_qkv`, `txt_attn_qkv`).

Unfused the drop-in way (`surgery_rewrites.diffusers_common.joyimage_family`): the stock classes and forwards stay;
each fused Linear becomes a `SplitRows` (rows -> `.q`, `.k`, `.v`: views), and the processor runs its head-dim twin.
The feed-forwards are diffusers' `FeedForward` (approximate GELU, planned in diffusers_common); the modulation is a
parameter table, no Linear. 4 all-reduces per block: each stream's attention output and feed-forward output.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_joyimage import (
    JoyImageAttention,
    JoyImageAttnProcessor,
    JoyImageEditTransformer3DModel,
)

from surgery_rewrites.diffusers_common import cast_inputs, joyimage_family, video_grid


def joyimage_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `JoyImageEditTransformer3DModel.forward`, as diffusers' own model test builds
    them: a latent of `image_tokens` patches (`(batch, channels, frames, height, width)`), the text states and a
    timestep."""
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = video_grid(image_tokens)
    p_t, p_h, p_w = config.get("patch_size", (1, 2, 2))
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), frames * p_t, height * p_h, width * p_w,
                                  generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_dim", 4096), generator=generator),
    )
    return cast_inputs(inputs, dtype, device)


FAMILY = joyimage_family("joyimage-edit", JoyImageEditTransformer3DModel,
                         JoyImageAttention, JoyImageAttnProcessor, "edit", joyimage_inputs)
