"""`Kandinsky5Transformer3DModel` (diffusers `transformer_kandinsky.py`): the `kandinsky5` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Attention, Kandinsky5Transformer3DModel

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import cast_inputs


def kandinsky5_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                      dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `Kandinsky5Transformer3DModel.forward`: a channels-last latent video of
    `image_tokens` patches (two frames; with `visual_cond`, the conditioning frames and their mask beside the noise,
    as the pipeline concatenates them), the Qwen text and the pooled CLIP embedding, and the rotary positions the
    pipeline builds (an arange per latent axis in patches, one over the text)."""
    generator = torch.Generator().manual_seed(seed)
    frames, (_, p_h, p_w) = 2, config.get("patch_size", (1, 2, 2))
    side = int((image_tokens // frames) ** 0.5)
    channels = config.get("in_visual_dim", 4)
    channels = 2 * channels + 1 if config.get("visual_cond", False) else channels
    inputs = dict(
        hidden_states=torch.randn(batch, frames, side * p_h, side * p_w, channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("in_text_dim", 3584), generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        pooled_projections=torch.randn(batch, config.get("in_text_dim2", 768), generator=generator),
    )
    positions = dict(visual_rope_pos=[torch.arange(n, device=device) for n in (frames, side, side)],
                     text_rope_pos=torch.arange(text_tokens, device=device))
    return {**cast_inputs(inputs, dtype, device), **positions}


FAMILY = derived_family(
    "kandinsky5", Kandinsky5Transformer3DModel, attention=(Kandinsky5Attention,),
    variants={"t2v-lite": dict(in_visual_dim=16, out_visual_dim=16, time_dim=512, patch_size=(1, 2, 2),
                               model_dim=1792, ff_dim=7168, num_text_blocks=2, num_visual_blocks=32,
                               axes_dims=(16, 24, 24), in_text_dim=3584, in_text_dim2=768, visual_cond=True)},
    sources="transformer/config.json of kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers (the Kandinsky 5.0 "
    "T2V Lite DiT of ai-forever/Kandinsky-5: 2 text and 32 visual blocks, width 1792 = 28 heads of 64 "
    "(axes 16 + 24 + 24), feed-forward 7168, Qwen2.5-VL text 3584, CLIP-L pooled 768)",
    default_variant="t2v-lite",
    example_inputs=kandinsky5_inputs,
    tests=Tests(
        # its rotary casts q and k to bfloat16 (`apply_rotary`'s `.to(torch.bfloat16)`), also in a float32 model
        rounds_to=torch.bfloat16,
        configs={"tiny": dict(in_visual_dim=4, out_visual_dim=4, time_dim=16, patch_size=(1, 2, 2), model_dim=32,
                              ff_dim=64, num_text_blocks=1, num_visual_blocks=2, axes_dims=(2, 2, 4),
                              in_text_dim=16, in_text_dim2=8, visual_cond=True)},
    ),
)
