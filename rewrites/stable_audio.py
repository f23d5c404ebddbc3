"""Stable Audio Open (diffusers `stable_audio_transformer.py`): a 1-D DiT over audio latents with grouped-query self
attention, text cross attention and a prepended global token. Plans, the attention path and the all-reduce count are
derived."""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention, StableAudioAttnProcessor2_0
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from diffusers.models.transformers.stable_audio_transformer import StableAudioDiTModel

from surgery.extend import Tests, derived_family


def stable_audio_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `StableAudioDiTModel.forward`, as diffusers' StableAudioPipeline builds them:
    `(B, C, image_tokens)` audio latents, a timestep, the projected text, one global (duration) token and the rotary
    table over the latents and that token, of half the head size."""
    generator = torch.Generator().manual_seed(seed)
    cos, sin = get_1d_rotary_pos_embed(config.get("attention_head_dim", 64) // 2, image_tokens + 1, use_real=True,
                                       repeat_interleave_real=False)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 64), image_tokens, generator=generator),
        timestep=torch.rand(batch, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("cross_attention_input_dim", 768),
                                          generator=generator),
        global_hidden_states=torch.randn(batch, 1, config.get("global_states_input_dim", 1536), generator=generator),
    )
    inputs = {k: v.to(device=device, dtype=dtype) for k, v in inputs.items()}
    inputs["rotary_embedding"] = (cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype))
    return inputs


FAMILIES = (
    derived_family(
        "stable-audio", StableAudioDiTModel, attention=(Attention,), processors=(StableAudioAttnProcessor2_0,),
        variants={"open-1.0": {}},
        sources="diffusers 0.42.1 StableAudioDiTModel defaults (24 blocks, 24 query and 12 key/value heads of 64, "
        "768-wide text, 1536-wide global states), taken as stabilityai/stable-audio-open-1.0's (the pipeline's "
        "example checkpoint; its config.json unverified here)",
        default_variant="open-1.0",
        example_inputs=stable_audio_inputs,
        tests=Tests(
            # diffusers' StableAudioPipelineFastTests transformer (diffusers 0.42.1 has no StableAudioDiT model test),
            # with 4 key/value heads (theirs: 2, which a mesh of 4 cannot split); 24 query heads of 4
            configs={"tiny": dict(sample_size=4, in_channels=3, num_layers=2, attention_head_dim=4,
                                  num_key_value_attention_heads=4, out_channels=3, cross_attention_dim=4,
                                  time_proj_dim=8, global_states_input_dim=8, cross_attention_input_dim=4)},
        ),
    ),
)
