"""MiniMax-H3 (diffusers `transformer_minimax_h3.py`): one packed sequence of video, audio and text rows. Its processor
reshapes by the stored head count only, so it runs its head-dim twin (derived, the fast path); plans and the
all-reduce count are derived. Its outputs are the video and the audio rows: the suite compares the video."""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Attention, MiniMaxH3Transformer3DModel

from surgery.extend import Tests, derived_family


def minimax_h3_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                      dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `MiniMaxH3Transformer3DModel.forward`, packed as diffusers' own model test packs
    them: `text_tokens` text rows, as many audio rows, then `image_tokens` video rows; two timesteps (video and text
    rows on the first, audio on the second), `(t, h, w)` positions and each modality's row indices."""
    generator = torch.Generator().manual_seed(seed)
    audio_tokens = text_tokens
    seq = text_tokens + audio_tokens + image_tokens
    text = torch.arange(text_tokens)
    audio = torch.arange(text_tokens, text_tokens + audio_tokens)
    video = torch.arange(text_tokens + audio_tokens, seq)
    tags = torch.zeros(seq, dtype=torch.long)
    tags[text], tags[audio] = 1, 2
    timestep_indices = torch.zeros(seq, dtype=torch.long)
    timestep_indices[audio] = 1
    positions = torch.zeros(seq, 3, dtype=torch.long)  # integer coordinates (diffusers' test: as floats)
    positions[:, 0] = torch.arange(seq)
    positions[video, 1] = torch.arange(image_tokens) % 4
    positions[video, 2] = torch.arange(image_tokens) % 2
    t, h, w = config.get("patch_size", (1, 2, 2))
    inputs = dict(
        hidden_states=torch.randn(batch, image_tokens, config.get("in_channels", 24) * t * h * w, generator=generator),
        audio_hidden_states=torch.randn(batch, audio_tokens, config.get("audio_in_channels", 32), generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_dim", 5120), generator=generator),
        timestep=torch.rand(2, generator=generator),
        timestep_indices=timestep_indices, token_tags=tags, position_ids=positions,
        video_indices=video, audio_indices=audio, text_indices=text,
    )
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


FAMILIES = (
    derived_family(
        "minimax-h3", MiniMaxH3Transformer3DModel, attention=(MiniMaxH3Attention,),
        variants={"h3": dict(num_attention_heads=56, attention_head_dim=128, hidden_size=5376, num_layers=50,
                             num_refiner_layers=2, ffn_dim=14336, in_channels=24, audio_in_channels=32,
                             patch_size=(1, 2, 2), text_dim=5120, freq_dim=256, time_embed_hidden_dim=5376,
                             time_embed_dim=2688, rope_freq_dim=16, rope_theta=10000.0, norm_eps=1e-05,
                             qk_norm_eps=1e-05, final_norm_eps=1e-05)},
        sources="diffusers scripts/convert_minimax_h3_to_diffusers.py, MINIMAX_H3_TRANSFORMER_CONFIG",
        default_variant="h3",
        example_inputs=minimax_h3_inputs,
        tests=Tests(
            # diffusers' MiniMaxH3TransformerTesterConfig with 4 heads (theirs: 2, which a mesh of 4 cannot split); the
            # attention width (64) still differs from the model's (24), and 2 x 3 x rope_freq_dim (12) stays below the
            # head size, so the partial-rotary path runs
            configs={"tiny": dict(num_attention_heads=4, attention_head_dim=16, hidden_size=24, num_layers=2,
                                  num_refiner_layers=2, ffn_dim=32, in_channels=4, audio_in_channels=6,
                                  patch_size=(1, 2, 2), text_dim=8, freq_dim=8, time_embed_hidden_dim=24,
                                  time_embed_dim=16, rope_freq_dim=2)},
        ),
    ),
)
