"""Video DiTs built like Wan, derived from diffusers' building blocks (`surgery.extend.derived_family`): one row per
model class, data only (published configs with their source, tiny test configs, example inputs for the forwards that
take more than a video and a text). Plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`)."""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers import transformer_wan_animate as animate
from diffusers.models.transformers.transformer_cosmos import CosmosTransformer3DModel
from diffusers.models.transformers.transformer_helios import HeliosAttention, HeliosTransformer3DModel

from surgery.extend import derived_family
from surgery_rewrites.derived import _WAN, _WAN_TINY, wan_inputs
from surgery_rewrites.hunyuan_video import video_grid


def helios_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `HeliosTransformer3DModel.forward`: a video latent of `image_tokens` patches and,
    as Helios' autoregressive sampler passes them, its three histories (one short frame at full resolution, one mid
    frame and four long frames, which the model patches 2x and 4x coarser) with the frame indices of each; the text."""
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = video_grid(image_tokens)
    p_t, p_h, p_w = config.get("patch_size", (1, 2, 2))
    channels = config.get("in_channels", 16)
    size = (height * p_h, width * p_w)

    def latent(count: int) -> torch.Tensor:
        return torch.randn(batch, channels, count * p_t, *size, generator=generator)

    def indices(start: int, count: int) -> torch.Tensor:
        return torch.arange(start, start + count).unsqueeze(0).expand(batch, -1)

    inputs = dict(
        hidden_states=latent(frames),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_dim", 4096), generator=generator),
        latents_history_long=latent(4), indices_latents_history_long=indices(0, 4),
        latents_history_mid=latent(1), indices_latents_history_mid=indices(4, 1),
        latents_history_short=latent(1), indices_latents_history_short=indices(5, 1),
        indices_hidden_states=indices(6, frames),
    )
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


def wan_animate_inputs(config: dict, batch: int = 1, image_tokens: int = 16, seed: int = 0,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", **kwargs) -> dict:
    """`wan_inputs` (the video latent with its reference-image channels, the CLIP image tokens, the text) plus what
    WanAnimate's forward adds: the pose latents (one frame fewer than the video, the reference frame having none)
    and the face video in pixels at the motion encoder's resolution, `4 (frames - 1) - 3` frames long (77 for 21
    latent frames, as the pipeline passes it), so that the face encoder's two stride-2 convolutions and its leading
    pad frame give one motion token per latent frame (the face adapters attend per frame)."""
    inputs = wan_inputs(config, batch=batch, image_tokens=image_tokens, seed=seed, dtype=dtype, device=device,
                        **kwargs)
    generator = torch.Generator().manual_seed(seed + 1)
    video = inputs["hidden_states"]
    latent = config.get("latent_channels", (config.get("in_channels", 36) - 4) // 2)
    frames = video.shape[2]
    size = config.get("motion_encoder_size", 512)
    extra = dict(
        pose_hidden_states=torch.randn(batch, latent, frames - 1, *video.shape[3:], generator=generator),
        face_pixel_values=torch.randn(batch, 3, max(1, 4 * (frames - 1) - 3), size, size, generator=generator),
    )
    return {**inputs, **{k: v.to(device=device, dtype=dtype) for k, v in extra.items()}}


# the numbers every Cosmos config shares
_COSMOS = dict(out_channels=16, attention_head_dim=128, mlp_ratio=4.0, text_embed_dim=1024, adaln_lora_dim=256,
               max_size=(128, 240, 240), patch_size=(1, 2, 2), concat_padding_mask=True, extra_pos_embed_type=None)
# head size 12: the rotary embedding splits it in thirds of even sizes (h and w 4, t 4)
_COSMOS_TINY = dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=12, num_layers=2,
                    mlp_ratio=2.0, text_embed_dim=16, adaln_lora_dim=8, max_size=(8, 16, 16),
                    concat_padding_mask=False)


def cosmos_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `CosmosTransformer3DModel.forward`: a video latent of `image_tokens` patches with
    all `in_channels` (a Video2World condition mask is one of them), its frame rate, the text (as wide as the
    Predict2.5 cross-attention projection reads, where the config has one) and, where the config concatenates one,
    the padding mask."""
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = video_grid(image_tokens)
    p_t, p_h, p_w = config.get("patch_size", (1, 2, 2))
    text = (config.get("crossattn_proj_in_channels", 1024) if config.get("use_crossattn_projection")
            else config.get("text_embed_dim", 1024))
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), frames * p_t, height * p_h, width * p_w,
                                  generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text_tokens, text, generator=generator),
    )
    if config.get("concat_padding_mask", True):
        inputs["padding_mask"] = torch.zeros(1, 1, height * p_h, width * p_w)
    inputs = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
    return {**inputs, "fps": 24}


FAMILIES = (
    derived_family(
        "helios", HeliosTransformer3DModel, attention=(HeliosAttention,),
        variants={
            "14b": dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
                        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_dim=(44, 42, 42),
                        rope_theta=10000.0, guidance_cross_attn=True, zero_history_timestep=True,
                        has_multi_term_memory_patch=True, is_amplify_history=False),
        },
        sources="diffusers HeliosTransformer3DModel's defaults, the 14B transformer of BestWishYsh/Helios-Base, -Mid "
        "and -Distilled (docs/source/en/api/models/helios_transformer3d.md; FastVideo's Helios tests check the "
        "Helios-Distilled transformer/config.json against these numbers, is_amplify_history off)",
        default_variant="14b",
        example_inputs=helios_inputs,
        test_configs={"tiny": dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
                                   text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_dim=(2, 2, 4))},
    ),
    # its face adapters (a cross attention to the motion tokens after every fifth block) derive like any attention;
    # the motion encoder (a StyleGAN-like conv net with MotionLinear layers, 512 wide) and the face encoder (Conv1d
    # layers, one Linear to the model width) read the face video once per forward ahead of the blocks, whole on
    # every rank like the other embedders
    derived_family(
        "wan-animate", animate.WanAnimateTransformer3DModel,
        attention=(animate.WanAttention, animate.WanAnimateFaceBlockCrossAttention),
        variants={
            "14b": {**_WAN, "ffn_dim": 13824, "in_channels": 36, "num_attention_heads": 40, "num_layers": 40,
                    "image_dim": 1280, "added_kv_proj_dim": 5120, "rope_max_seq_len": 1024,
                    "pos_embed_seq_len": None, "motion_encoder_size": 512, "motion_style_dim": 512,
                    "motion_dim": 20, "motion_encoder_dim": 512, "face_encoder_hidden_dim": 1024,
                    "face_encoder_num_heads": 4, "inject_face_latents_blocks": 5},
        },
        sources="diffusers scripts/convert_wan_to_diffusers.py (get_transformer_config: Wan2.2-Animate-14B)",
        default_variant="14b",
        example_inputs=wan_animate_inputs,
        test_configs={"tiny": {**_WAN_TINY, "in_channels": 12, "latent_channels": 4, "image_dim": 8,
                               "added_kv_proj_dim": 32, "motion_encoder_size": 16,
                               "motion_encoder_channel_sizes": {"4": 8, "8": 8, "16": 8}, "motion_style_dim": 8,
                               "motion_dim": 4, "motion_encoder_dim": 8, "face_encoder_hidden_dim": 8,
                               "face_encoder_num_heads": 2, "inject_face_latents_blocks": 1}},
    ),
    derived_family(
        "cosmos", CosmosTransformer3DModel, attention=(Attention,),
        variants={name: {**_COSMOS, **config} for name, config in {
            "1.0-7b-text2world": dict(in_channels=16, num_attention_heads=32, num_layers=28,
                                      rope_scale=(2.0, 1.0, 1.0), extra_pos_embed_type="learnable"),
            "1.0-7b-video2world": dict(in_channels=17, num_attention_heads=32, num_layers=28,
                                       rope_scale=(2.0, 1.0, 1.0), extra_pos_embed_type="learnable"),
            "1.0-14b-text2world": dict(in_channels=16, num_attention_heads=40, num_layers=36,
                                       rope_scale=(2.0, 2.0, 2.0), extra_pos_embed_type="learnable"),
            "1.0-14b-video2world": dict(in_channels=17, num_attention_heads=40, num_layers=36,
                                        rope_scale=(2.0, 2.0, 2.0), extra_pos_embed_type="learnable"),
            "predict2-2b-text2image": dict(in_channels=16, num_attention_heads=16, num_layers=28,
                                           rope_scale=(1.0, 4.0, 4.0)),
            "predict2-14b-text2image": dict(in_channels=16, num_attention_heads=40, num_layers=36,
                                            rope_scale=(1.0, 4.0, 4.0)),
            "predict2-2b-video2world": dict(in_channels=17, num_attention_heads=16, num_layers=28,
                                            rope_scale=(1.0, 3.0, 3.0)),
            "predict2-14b-video2world": dict(in_channels=17, num_attention_heads=40, num_layers=36,
                                             rope_scale=(20 / 24, 2.0, 2.0)),
            "predict2.5-2b": dict(in_channels=17, num_attention_heads=16, num_layers=28, rope_scale=(1.0, 3.0, 3.0),
                                  use_crossattn_projection=True, crossattn_proj_in_channels=100352,
                                  encoder_hidden_states_channels=1024),
            "predict2.5-14b": dict(in_channels=17, num_attention_heads=40, num_layers=36, rope_scale=(1.0, 3.0, 3.0),
                                   use_crossattn_projection=True, crossattn_proj_in_channels=100352,
                                   encoder_hidden_states_channels=1024),
        }.items()},
        sources="diffusers scripts/convert_cosmos_to_diffusers.py (TRANSFORMER_CONFIGS: Cosmos-1.0-Diffusion-7B/14B-"
        "Text2World/Video2World, Cosmos-2.0-Diffusion-2B/14B-Text2Image/Video2World, Cosmos-2.5-Predict-Base-2B/14B; "
        "Cosmos-2.5-Transfer's image-context attention is refused: its CosmosAttnProcessor2_5 views the image "
        "q/k/v by the stored head count)",
        default_variant="1.0-7b-text2world",
        example_inputs=cosmos_inputs,
        # no padding mask: diffusers resizes it with torchvision, which this stack does not install (the mask is one
        # more input channel, read by the patch embedding every rank holds whole)
        test_configs={
            "tiny": {**_COSMOS_TINY, "extra_pos_embed_type": "learnable"},
            "tiny_predict2.5": {**_COSMOS_TINY, "extra_pos_embed_type": None, "use_crossattn_projection": True,
                                "crossattn_proj_in_channels": 24, "encoder_hidden_states_channels": 16},
        },
    ),
)
