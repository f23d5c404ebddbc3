"""LongCat-AudioDiT (diffusers `transformer_longcat_audio_dit.py`): an audio DiT with self and cross attention. Its
self-attention processor reads the stored head count beyond a reshape, so it runs unmodified on DTensor q/k/v
(`surgery.parallel.dtensor_attention`); the cross attention's runs its head-dim twin; plans and the all-reduce count
are derived."""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_longcat_audio_dit import (
    AudioDiTAttention,
    AudioDiTCrossAttnProcessor,
    AudioDiTSelfAttnProcessor,
    LongCatAudioDiTTransformer,
)

from surgery.extend import Tests, derived_family


def longcat_audio_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                         dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `LongCatAudioDiTTransformer.forward`, as diffusers' own model test builds them:
    `image_tokens` audio latent frames, the text with its mask (here the last token padding), a timestep."""
    generator = torch.Generator().manual_seed(seed)
    text_mask = torch.ones(batch, text_tokens, dtype=torch.bool)
    text_mask[:, -1] = False
    inputs = dict(
        hidden_states=torch.randn(batch, image_tokens, config.get("latent_dim", 64), generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("dit_text_dim", 768), generator=generator),
        encoder_attention_mask=text_mask,
        attention_mask=torch.ones(batch, image_tokens, dtype=torch.bool),
        timestep=torch.rand(batch, generator=generator),
    )
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


FAMILIES = (
    derived_family(
        "longcat-audio-dit", LongCatAudioDiTTransformer, attention=(AudioDiTAttention,),
        processors=(AudioDiTSelfAttnProcessor, AudioDiTCrossAttnProcessor),
        variants={"1b": {}},
        sources="diffusers scripts/convert_longcat_audio_dit_to_diffusers.py (--repo_id "
        "meituan-longcat/LongCat-AudioDiT-1B) builds LongCatAudioDiTTransformer from the checkpoint's dit_* keys; "
        "diffusers 0.42.1's class defaults (1536 wide, 24 blocks, 24 heads, 768-wide text, 64 latent channels) are "
        "that model's",
        default_variant="1b",
        example_inputs=longcat_audio_inputs,
        tests=Tests(
            # diffusers' LongCatAudioDiTTransformerTesterConfig
            configs={"tiny": dict(dit_dim=64, dit_depth=2, dit_heads=4, dit_text_dim=32, latent_dim=8,
                                  text_conv=False)},
        ),
    ),
)
