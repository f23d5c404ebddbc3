"""Families derived from diffusers' building blocks (`surgery.extend.derived_family`): one row per model
class, data only: published configs with their source, tiny test configs, example inputs.

Their rewrites (head-dim twins of the attention processors, elementwise q/k RMS norms) and their plans (q/k/v
colwise, outputs rowwise, norms across heads by their statistic, FeedForward's shared plan) are derived; so is the
all-reduce count.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers import transformer_chronoedit as chronoedit
from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2Attention, SkyReelsV2Transformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttention, WanTransformer3DModel
from diffusers.models.transformers.transformer_wan_vace import WanVACETransformer3DModel, WanVACETransformerBlock

from surgery.extend import derived_family
from surgery_rewrites.hunyuan_video import video_grid


def wan_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `WanTransformer3DModel.forward`: a video latent of `image_tokens` patches; for an
    image-to-video config (`image_dim`), 16 image-embedding tokens (the published models take CLIP's 257; with very
    few, the image cross-attention's key gradients are differences of near-equal terms, whose fp32 rounding decides
    them), and the text padded to the 512 tokens its cross attention expects (the image tokens are what precedes the
    last 512)."""
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = video_grid(image_tokens)
    p_t, p_h, p_w = config.get("patch_size", (1, 2, 2))
    text = 512 if config.get("image_dim") else text_tokens
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), frames * p_t, height * p_h, width * p_w,
                                  generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text, config.get("text_dim", 4096), generator=generator),
    )
    if config.get("image_dim"):
        inputs["encoder_hidden_states_image"] = torch.randn(batch, 16, config["image_dim"], generator=generator)
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


def wan_vace_inputs(config: dict, **kwargs) -> dict:
    """`wan_inputs` plus a control video of `vace_in_channels` on the same latent grid."""
    inputs = wan_inputs(config, **kwargs)
    video = inputs["hidden_states"]
    generator = torch.Generator().manual_seed(kwargs.get("seed", 0) + 1)
    control = torch.randn(video.shape[0], config.get("vace_in_channels", 96), *video.shape[2:], generator=generator)
    return {**inputs, "control_hidden_states": control.to(video)}


_WAN = dict(attention_head_dim=128, cross_attn_norm=True, eps=1e-06, freq_dim=256, out_channels=16,
            patch_size=(1, 2, 2), qk_norm="rms_norm_across_heads", text_dim=4096)
_WAN_TINY = dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
                 freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32)

FAMILIES = (
    derived_family(
        "wan", WanTransformer3DModel, attention=(WanAttention,),
        variants={
            "t2v-1.3b": {**_WAN, "ffn_dim": 8960, "in_channels": 16, "num_attention_heads": 12, "num_layers": 30},
            "t2v-14b": {**_WAN, "ffn_dim": 13824, "in_channels": 16, "num_attention_heads": 40, "num_layers": 40},
            "i2v-14b": {**_WAN, "ffn_dim": 13824, "in_channels": 36, "num_attention_heads": 40, "num_layers": 40,
                        "image_dim": 1280, "added_kv_proj_dim": 5120},
            "2.2-ti2v-5b": {**_WAN, "ffn_dim": 14336, "in_channels": 48, "out_channels": 48,
                            "num_attention_heads": 24, "num_layers": 30},
        },
        sources="diffusers scripts/convert_wan_to_diffusers.py (get_transformer_config: Wan-T2V-1.3B, Wan-T2V-14B, "
        "Wan-I2V-14B-480p, Wan2.2-TI2V-5B)",
        default_variant="t2v-14b",
        example_inputs=wan_inputs,
        test_configs={"tiny": _WAN_TINY, "tiny_i2v": {**_WAN_TINY, "image_dim": 8, "added_kv_proj_dim": 32}},
    ),
    derived_family(
        "skyreels-v2", SkyReelsV2Transformer3DModel, attention=(SkyReelsV2Attention,),
        variants={
            "df-1.3b": {**_WAN, "ffn_dim": 8960, "in_channels": 16, "num_attention_heads": 12, "num_layers": 30,
                        "inject_sample_info": True},
            "t2v-14b": {**_WAN, "ffn_dim": 13824, "in_channels": 16, "num_attention_heads": 40, "num_layers": 40},
            "i2v-1.3b": {**_WAN, "ffn_dim": 8960, "in_channels": 36, "num_attention_heads": 12, "num_layers": 30,
                         "image_dim": 1280, "added_kv_proj_dim": 1536},
        },
        sources="diffusers scripts/convert_skyreelsv2_to_diffusers.py (SkyReels-V2-DF-1.3B-540P, "
        "SkyReels-V2-T2V-14B-720P, SkyReels-V2-I2V-1.3B-540P)",
        default_variant="t2v-14b",
        example_inputs=wan_inputs,
        test_configs={"tiny": _WAN_TINY},
    ),
    derived_family(
        "chronoedit", chronoedit.ChronoEditTransformer3DModel, attention=(chronoedit.WanAttention,),
        variants={
            "14b": {**_WAN, "ffn_dim": 13824, "in_channels": 36, "num_attention_heads": 40, "num_layers": 40,
                    "image_dim": 1280, "added_kv_proj_dim": 5120, "rope_max_seq_len": 1024},
        },
        sources="nvidia/ChronoEdit-14B-Diffusers: Wan2.1-I2V-14B's transformer (diffusers scripts/"
        "convert_wan_to_diffusers.py, Wan-I2V-14B-720p; the same numbers in an early copy of its transformer/"
        "config.json, huggingface.co/NopenAI/nv-chronoedit) with ChronoEdit's default rope_temporal_skip_len=8",
        default_variant="14b",
        # 16 image tokens make 2 latent frames: ChronoEdit's two-frame (edit) rotary path
        example_inputs=wan_inputs,
        test_configs={"tiny_i2v": {**_WAN_TINY, "image_dim": 8, "added_kv_proj_dim": 32}, "tiny": _WAN_TINY},
    ),
    derived_family(
        "wan-vace", WanVACETransformer3DModel, attention=(WanAttention,),
        variants={
            "1.3b": {**_WAN, "ffn_dim": 8960, "in_channels": 16, "num_attention_heads": 12, "num_layers": 30,
                     "vace_layers": list(range(0, 30, 2)), "vace_in_channels": 96},
        },
        sources="diffusers scripts/convert_wan_to_diffusers.py (get_transformer_config: Wan-VACE-1.3B)",
        default_variant="1.3b",
        example_inputs=wan_vace_inputs,
        test_configs={"tiny": {**_WAN_TINY, "vace_layers": [0, 1], "vace_in_channels": 8}},
        # the VACE hint projections: proj_in reads the patch-embedded control video, proj_out writes the hint added
        # to the main stream; both full-width hidden states every rank holds whole between the sharded attentions
        replicated={WanVACETransformerBlock: dict.fromkeys(
            ("proj_in", "proj_out"), "VACE hint projection of full-width hidden states every rank holds whole")},
    ),
)
