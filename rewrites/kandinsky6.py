"""Kandinsky 6 (diffusers `transformer_kandinsky6.py`): a text/image-to-video-and-audio transformer whose fused blocks
denoise video and audio together (self, text-cross and video<->audio cross attention per modality), each modality
with its own text branch. Its processor reshapes by the stored head count only; plans, the attention path and the
all-reduce count are derived. Its outputs are the video and the audio: the suite compares the video."""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_kandinsky6 import Kandinsky6Attention, Kandinsky6Transformer3DModel

from surgery.extend import Tests, derived_family


def kandinsky6_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                      dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `Kandinsky6Transformer3DModel.forward`: one frame of `(B, T, H, W, C)` video
    latents whose patches make `image_tokens` tokens (with `visual_cond`, the noisy latent, the conditioning latent and
    a mask: `2 * in_visual_dim + 1` channels), `text_tokens` audio frames, the text with its pooled embedding, a
    timestep on the `[0, 1000]` scale and a text mask whose last token is padding."""
    generator = torch.Generator().manual_seed(seed)
    _, p_h, p_w = config.get("patch_size", (1, 2, 2))
    side = int(image_tokens ** 0.5)
    visual = config.get("in_visual_dim", 16)
    channels = 2 * visual + 1 if config.get("visual_cond", True) else visual
    mask = torch.ones(batch, text_tokens, dtype=torch.bool)
    mask[:, -1] = False
    inputs = dict(
        hidden_states=torch.randn(batch, 1, side * p_h, side * p_w, channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("in_text_dim", 3584), generator=generator),
        pooled_projections=torch.randn(batch, config.get("in_text_dim2", 768), generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        audio_hidden_states=torch.randn(batch, text_tokens, config.get("in_audio_dim", 20), generator=generator),
        encoder_attention_mask=mask,
    )
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


# what the class docstring says every released checkpoint sets (the False defaults describe no shipped weights)
RELEASED = dict(text_token_padding=True, ca_rope=True, cross_gates=True, fix_modulation=True)

FAMILIES = (
    derived_family(
        "kandinsky6", Kandinsky6Transformer3DModel, attention=(Kandinsky6Attention,),
        variants={"pro": dict(RELEASED)},
        sources="diffusers 0.42.1 Kandinsky6Transformer3DModel: its defaults (4096 wide, 60 fused blocks, head size "
        "32+48+48 = 128, 16384 feed-forward, 3584-wide Qwen2.5-VL text, 768-wide CLIP pooled) with the four flags its "
        "docstring says every released checkpoint sets (kandinskylab/Kandinsky-6.0-Pro-distill-5s-Diffusers)",
        default_variant="pro",
        example_inputs=kandinsky6_inputs,
        tests=Tests(
            # diffusers 0.42.1 ships no Kandinsky6 model test (none in its tests/models/transformers), so this is the
            # smallest config of the released architecture: head size 4+2+2 = 8, 4 heads in every attention (a mesh of 2
            # and 4 splits them), one text block per modality and one fused block. Through two fused blocks the second
            # one's audio and video q/k norm weight gradients (sums over tokens that nearly cancel) moved by 3.7e-5 of
            # their scale under the sharded summation order at world 2 (float64: 1e-14; heads of 16 no better); through
            # one, by 3.8e-6 at most (world 2)
            configs={"tiny": dict(RELEASED, in_visual_dim=4, out_visual_dim=4, in_text_dim=16, in_text_dim2=8,
                                  time_dim=16, model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=1,
                                  axes_dims=(4, 2, 2), in_audio_dim=4, out_audio_dim=4)},
        ),
    ),
)
