"""Krea 2 (diffusers `transformer_krea2.py`): a single-stream MMDiT with grouped-query attention and a sigmoid gate as
wide as the attention output.

Its processor unflattens by `num_heads` / `num_kv_heads` and repeats key/value heads by their ratio: no head-dim twin
fits it, so it runs unmodified on DTensor q/k/v (`surgery.parallel.dtensor_attention`); the plans, all-reduce count
and the SwiGLU feed-forward's plan are derived. The text-fusion transformer sits outside the transformer blocks: whole
on every rank.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_krea2 import Krea2Attention, Krea2Transformer2DModel

from surgery.extend import Tests, derived_family


def krea2_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `Krea2Transformer2DModel.forward`, as diffusers' own model test builds them: packed
    image latents on a square grid, the stack of tapped text-encoder states, a timestep in [0, 1], the `(t, h, w)`
    positions of `[text, image]` and a text mask whose last token is padding."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5)
    channels = config.get("in_channels", 64)
    positions = torch.zeros(text_tokens + side * side, 3)
    positions[text_tokens:, 1] = torch.arange(side).repeat_interleave(side)
    positions[text_tokens:, 2] = torch.arange(side).repeat(side)
    mask = torch.ones(batch, text_tokens, dtype=torch.bool)
    mask[:, -1] = False
    inputs = dict(
        hidden_states=torch.randn(batch, side * side, channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("num_text_layers", 12),
                                          config.get("text_hidden_dim", 2560), generator=generator),
        timestep=torch.rand(batch, generator=generator),
        position_ids=positions,
        encoder_attention_mask=mask,
    )
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() and k != "position_ids" else v.dtype)
            for k, v in inputs.items()}


FAMILIES = (
    derived_family(
        "krea2", Krea2Transformer2DModel, attention=(Krea2Attention,),
        variants={"2": {}},
        sources="diffusers 0.42.1 Krea2Transformer2DModel: its defaults are the Krea 2 backbone's (the class "
        "docstring: 28 blocks, 48 query heads and 12 key/value heads of 128, SwiGLU 16384, a text fusion over 12 "
        "tapped layers of a 2560-wide text encoder)",
        default_variant="2",
        example_inputs=krea2_inputs,
        tests=Tests(
            # diffusers' Krea2TransformerTesterConfig, with 8 query and 4 key/value heads (theirs: 4 and 2) so that a
            # mesh of 4 splits the key/value heads too, and grouped queries still repeat each key/value head twice
            configs={"tiny": dict(in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=8,
                                  num_key_value_heads=4, intermediate_size=32, timestep_embed_dim=8,
                                  text_hidden_dim=16, num_text_layers=3, text_num_attention_heads=2,
                                  text_num_key_value_heads=1, text_intermediate_size=16,
                                  num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 2, 2),
                                  rope_theta=1000.0, norm_eps=1e-5)},
        ),
    ),
)
