"""Ideogram 4 (diffusers `transformer_ideogram4.py`): one stream of text and image tokens with multimodal rotary
positions. Its processor reads the stored head count beyond a reshape, so it runs unmodified on DTensor q/k/v
(`surgery.parallel.dtensor_attention`); plans and the all-reduce count are derived (the SwiGLU `Ideogram4MLP` too)."""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_ideogram4 import (
    IMAGE_POSITION_OFFSET,
    LLM_TOKEN_INDICATOR,
    OUTPUT_IMAGE_INDICATOR,
    Ideogram4Attention,
    Ideogram4Transformer2DModel,
    Ideogram4TransformerBlock,
)

from surgery.extend import TensorParallel, Tests, derived_family


def ideogram4_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `Ideogram4Transformer2DModel.forward`, laid out as diffusers' own model test lays
    them: one sequence of `text_tokens` text rows then a square grid of image rows, latents zero on the text rows and
    text features zero on the image rows, positions `(t, h, w)` with the image offset, and the token indicators."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5)
    seq = text_tokens + side * side
    hidden = torch.zeros(batch, seq, config.get("in_channels", 128))
    hidden[:, text_tokens:] = torch.randn(batch, side * side, hidden.shape[-1], generator=generator)
    text = torch.zeros(batch, seq, config.get("llm_features_dim", 53248))
    text[:, :text_tokens] = torch.randn(batch, text_tokens, text.shape[-1], generator=generator)
    positions = torch.zeros(batch, seq, 3, dtype=torch.long)
    positions[:, :text_tokens] = torch.arange(text_tokens)[:, None]
    positions[:, text_tokens:, 0] = IMAGE_POSITION_OFFSET
    positions[:, text_tokens:, 1] = torch.arange(side).repeat_interleave(side) + IMAGE_POSITION_OFFSET
    positions[:, text_tokens:, 2] = torch.arange(side).repeat(side) + IMAGE_POSITION_OFFSET
    indicator = torch.full((batch, seq), OUTPUT_IMAGE_INDICATOR, dtype=torch.long)
    indicator[:, :text_tokens] = LLM_TOKEN_INDICATOR
    inputs = dict(hidden_states=hidden, encoder_hidden_states=text, timestep=torch.rand(batch, generator=generator),
                  position_ids=positions, segment_ids=torch.ones(batch, seq, dtype=torch.long), indicator=indicator)
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


FAMILIES = (
    derived_family(
        "ideogram4", Ideogram4Transformer2DModel, attention=(Ideogram4Attention,),
        variants={"4": {}},
        sources="diffusers 0.42.1 Ideogram4Transformer2DModel: its defaults are the Ideogram 4 backbone's (the class "
        "docstring: 34 blocks, 18 heads of 256, SwiGLU 12288, 53248 LLM features, M-RoPE sections (24, 20, 20))",
        default_variant="4",
        example_inputs=ideogram4_inputs,
        tp=TensorParallel(replicated={Ideogram4TransformerBlock: {
            "adaln_modulation": "adaptive-norm modulation of the replicated conditioning embedding"}}),
        tests=Tests(
            # diffusers' Ideogram4TransformerTesterConfig, the feed-forward 64 wide (theirs: 32, the model's width,
            # which leaves SwiGLU's output Linear unknown to the derivation)
            configs={"tiny": dict(in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
                                  intermediate_size=64, adaln_dim=16, llm_features_dim=24, rope_theta=10_000,
                                  mrope_section=(2, 1, 1), norm_eps=1e-5)},
        ),
    ),
)
