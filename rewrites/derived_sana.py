"""Sana's DiTs, derived from diffusers' building blocks (`surgery.extend.derived_family`): one row per model class,
data only (published configs with their source, tiny test configs, example inputs).

Their self-attention is linear attention (`SanaLinearAttnProcessor2_0` / `3_0`: ReLU kernels, then per-head sums
`V K^T Q`): every sum runs within one head, so it shards by heads like softmax attention, and the processor rule of
`surgery.core.leaves` gives those processors their head-dim twins (they reshape by `(attn.heads, -1)`); the cross
attention is diffusers' own processor in the older spelling, which the rule also reads.

Their feed-forward (`GLUMBConv`: 1x1 conv up to gate and value channels, a depthwise 3x3 conv, the GLU, a 1x1 conv
down) is Conv2d, not Linear: stock `ColwiseParallel`/`RowwiseParallel` refuse a Conv2d, and DTensor's convolution
shards only the batch or spatial dims with the weight whole, never its channels. It stays whole on every rank,
declared so, and `surgery plan` reports the bytes that leaves unsharded.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention, SanaLinearAttnProcessor2_0
from diffusers.models.transformers.sana_transformer import GLUMBConv, SanaAttnProcessor2_0, SanaTransformer2DModel
from diffusers.models.transformers.transformer_sana_video import GLUMBTempConv, SanaVideoTransformer3DModel

from surgery.extend import derived_family


def _cast(inputs: dict, dtype: torch.dtype, device) -> dict:
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


def _conditions(config: dict, batch: int, text_tokens: int, generator: torch.Generator) -> dict:
    """Caption features with their mask (the last two tokens padding: the cross attention's mask path runs), a
    timestep, and for a guidance-distilled config (Sana-Sprint) the guidance scale."""
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[:, -2:] = 0
    inputs = dict(
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("caption_channels", 2304),
                                          generator=generator),
        encoder_attention_mask=mask,
        timestep=torch.rand(batch, generator=generator) * 1000,
    )
    if config.get("guidance_embeds"):
        inputs["guidance"] = torch.rand(batch, generator=generator) * 5
    return inputs


def sana_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `SanaTransformer2DModel.forward`: a square latent of `image_tokens` patches plus
    `_conditions`."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 1)
    latent = torch.randn(batch, config.get("in_channels", 32), side, side, generator=generator)
    return _cast(dict(hidden_states=latent, **_conditions(config, batch, text_tokens, generator)), dtype, device)


def sana_video_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                      dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `SanaVideoTransformer3DModel.forward`: a latent video of `image_tokens` patches
    (frames of 2 x 2 patches; its temporal conv mixes them) plus `_conditions`."""
    generator = torch.Generator().manual_seed(seed)
    p_t, p_h, p_w = config.get("patch_size", (1, 2, 2))
    frames = max(1, image_tokens // 4)
    latent = torch.randn(batch, config.get("in_channels", 16), frames * p_t, 2 * p_h, 2 * p_w, generator=generator)
    return _cast(dict(hidden_states=latent, **_conditions(config, batch, text_tokens, generator)), dtype, device)


CONV_FEED_FORWARD = ("a Conv2d feed-forward (1x1 up, depthwise 3x3, GLU, 1x1 down): stock Colwise/RowwiseParallel "
                     "shard Linears only and DTensor's convolution never shards channels, so every rank holds it whole")

# diffusers scripts/convert_sana_to_diffusers.py: transformer_kwargs over model_kwargs[model_type]
_SANA = dict(in_channels=32, out_channels=32, caption_channels=2304, mlp_ratio=2.5, attention_bias=False,
             sample_size=32, patch_size=1, norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=None)
_SANA_1600M = dict(num_attention_heads=70, attention_head_dim=32, num_cross_attention_heads=20,
                   cross_attention_head_dim=112, cross_attention_dim=2240, num_layers=20)
_SANA_600M = dict(num_attention_heads=36, attention_head_dim=32, num_cross_attention_heads=16,
                  cross_attention_head_dim=72, cross_attention_dim=1152, num_layers=28)
_SPRINT = dict(qk_norm="rms_norm_across_heads", guidance_embeds=True)
# heads of Sana's 32: linear attention divides by a sum of ReLU kernels over the head's features and the tokens,
# which at heads of 8 and 16 tokens comes near zero often enough that fp32 rounding alone (a sum in another order)
# moves q's gradient by 1e-5, the gradient tolerance. The sharded case runs one block: through two, the q/k norms'
# weight gradients (sums over tokens that nearly cancel) differ from one device by up to 1.1e-5 over seeds 0-9 at
# world 2, at one block by 5.4e-6 at most
_SANA_TINY = dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=32,
                  num_cross_attention_heads=4, cross_attention_head_dim=32, cross_attention_dim=128,
                  caption_channels=16, num_layers=2, sample_size=4, mlp_ratio=2.5)

# diffusers scripts/convert_sana_video_to_diffusers.py: transformer_kwargs (480p: the Wan VAE, 720p: DC-AE-V)
_SANA_VIDEO = dict(num_attention_heads=20, attention_head_dim=112, num_layers=20, num_cross_attention_heads=20,
                   cross_attention_head_dim=112, cross_attention_dim=2240, caption_channels=2304, mlp_ratio=3.0,
                   attention_bias=False, norm_elementwise_affine=False, norm_eps=1e-6,
                   qk_norm="rms_norm_across_heads", rope_max_seq_len=1024)

FAMILIES = (
    derived_family(
        "sana", SanaTransformer2DModel, attention=(Attention,),
        processors=(SanaAttnProcessor2_0, SanaLinearAttnProcessor2_0),
        variants={
            "1600m-1024px": {**_SANA, **_SANA_1600M},
            "600m-1024px": {**_SANA, **_SANA_600M},
            "1600m-4kpx": {**_SANA, **_SANA_1600M, "sample_size": 128, "interpolation_scale": 2.0},
            "1.5-1600m": {**_SANA, **_SANA_1600M, "qk_norm": "rms_norm_across_heads"},
            "1.5-4800m": {**_SANA, **_SANA_1600M, "num_layers": 60, "qk_norm": "rms_norm_across_heads"},
            "sprint-1600m": {**_SANA, **_SANA_1600M, **_SPRINT},
            "sprint-600m": {**_SANA, **_SANA_600M, **_SPRINT},
        },
        sources="diffusers scripts/convert_sana_to_diffusers.py (model_kwargs: SanaMS_1600M_P1_D20, "
        "SanaMS_600M_P1_D28, SanaMS1.5_1600M_P1_D20, SanaMS1.5_4800M_P1_D60, SanaSprint_1600M_P1_D20, "
        "SanaSprint_600M_P1_D28; sample_size = image_size // 32, interpolation_scale by image size)",
        default_variant="1600m-1024px",
        example_inputs=sana_inputs,
        # the sharded case is Sprint's: q/k norms across heads and the guidance embedder
        test_configs={"tiny_sprint": {**_SANA_TINY, **_SPRINT, "num_layers": 1}, "tiny": _SANA_TINY},
        replicated={GLUMBConv: {"conv_*": CONV_FEED_FORWARD}},
    ),
    derived_family(
        "sana-video", SanaVideoTransformer3DModel, attention=(Attention,),
        variants={
            "2b-480p": {**_SANA_VIDEO, "sample_size": 30, "patch_size": (1, 2, 2), "in_channels": 16,
                        "out_channels": 16},
            "2b-720p": {**_SANA_VIDEO, "sample_size": 22, "patch_size": (1, 1, 1), "in_channels": 32,
                        "out_channels": 32},
        },
        sources="diffusers scripts/convert_sana_video_to_diffusers.py (SanaVideo: transformer_kwargs; 480p with the "
        "Wan VAE, 720p with DC-AE-V)",
        default_variant="2b-480p",
        example_inputs=sana_video_inputs,
        # heads of 24 and one block, for the reasons of _SANA_TINY's
        test_configs={"tiny": dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=24,
                                   num_cross_attention_heads=4, cross_attention_head_dim=24, cross_attention_dim=96,
                                   caption_channels=16, num_layers=1, sample_size=4, mlp_ratio=2.5,
                                   rope_max_seq_len=32)},
        replicated={GLUMBTempConv: {"conv_*": CONV_FEED_FORWARD + " (its temporal conv too)"}},
    ),
)

