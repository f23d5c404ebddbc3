"""JoyImage-Edit-Plus (diffusers `transformer_joyimage_edit_plus.py`): JoyImage-Edit's blocks for several reference
images (padded patch sequences, per-sample rotary tables, an attention mask). The same fused q/k/v and the same
unfusing as JoyImage-Edit (`surgery_rewrites.diffusers_common.joyimage_family`); 4 all-reduces per block.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_joyimage_edit_plus import (
    JoyImageEditPlusAttention,
    JoyImageEditPlusAttnProcessor,
    JoyImageEditPlusTransformer3DModel,
)

from surgery_rewrites.diffusers_common import cast_inputs, joyimage_family


def joyimage_edit_plus_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8,
                              seed: int = 0, dtype: torch.dtype = torch.float32,
                              device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `JoyImageEditPlusTransformer3DModel.forward`, laid out as diffusers' pipeline
    lays them: `image_tokens` patch slots (`(batch, slots, channels, pt, ph, pw)`) holding the target then one
    reference image, the last slot padding (masked out, its rotary table the identity); the text with its mask, the
    last token padding."""
    generator = torch.Generator().manual_seed(seed)
    p_t, p_h, p_w = config.get("patch_size", (1, 2, 2))
    used = image_tokens - 1
    target = (1, 1, used // 2)
    reference = (1, 1, used - used // 2)
    text_mask = torch.ones(batch, text_tokens, dtype=torch.long)  # the tokenizer's mask
    text_mask[:, -1] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, image_tokens, config.get("in_channels", 16), p_t, p_h, p_w,
                                  generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_dim", 4096), generator=generator),
        encoder_hidden_states_mask=text_mask,
        shape_list=[[target, reference] for _ in range(batch)],
    )
    return cast_inputs(inputs, dtype, device)


FAMILY = joyimage_family("joyimage-edit-plus", JoyImageEditPlusTransformer3DModel,
                         JoyImageEditPlusAttention, JoyImageEditPlusAttnProcessor, "plus", joyimage_edit_plus_inputs)
