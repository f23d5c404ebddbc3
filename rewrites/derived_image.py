"""Image DiTs derived from diffusers' building blocks (`surgery.extend.derived_family`): one row per model class,
data only (published configs with their source, tiny test configs, example inputs). Plans, rewrites and all-reduce
counts are derived (`surgery.parallel.derive`); the adaptive norms' Linears stay whole by the general rule of
`surgery.parallel.plans.replicated_reason`."""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_cogview4 import CogView4Transformer2DModel
from diffusers.models.transformers.transformer_hunyuan_video15 import (
    HunyuanVideo15TokenRefiner,
    HunyuanVideo15Transformer3DModel,
)
from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel

from surgery.extend import derived_family


def cogview4_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `CogView4Transformer2DModel.forward`: a square latent of `image_tokens` patches,
    the text, and the three SDXL-like size conditions."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), side, side, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_embed_dim", 4096), generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        original_size=torch.tensor([[1024.0, 1024.0]] * batch),
        target_size=torch.tensor([[1024.0, 1024.0]] * batch),
        crop_coords=torch.tensor([[0.0, 0.0]] * batch),
    )
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


def z_image_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `ZImageTransformer2DModel.forward`, which takes lists (one entry per sample): a
    one-frame latent `[channels, 1, h, w]` of `image_tokens` patches and the caption features `[tokens, dim]`."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("all_patch_size", (2,))[0]
    cast = dict(device=device, dtype=dtype)
    return dict(
        x=[torch.randn(config.get("in_channels", 16), 1, side, side, generator=generator).to(**cast)
           for _ in range(batch)],
        cap_feats=[torch.randn(text_tokens, config.get("cap_feat_dim", 2560), generator=generator).to(**cast)
                   for _ in range(batch)],
        t=(torch.rand(batch, generator=generator)).to(**cast),
    )


def hunyuan_video15_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8,
                           seed: int = 0, dtype: torch.dtype = torch.float32,
                           device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `HunyuanVideo15Transformer3DModel.forward`: a one-frame latent of `image_tokens`
    patches, both text streams with their masks (the last two tokens padding), and image embeddings (zero for
    text-to-video, which the model checks)."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 1)
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[:, -2:] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 65), 1, side, side, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_embed_dim", 3584), generator=generator),
        encoder_attention_mask=mask,
        encoder_hidden_states_2=torch.randn(batch, 4, config.get("text_embed_2_dim", 1472), generator=generator),
        encoder_attention_mask_2=torch.ones(batch, 4, dtype=torch.long),
        image_embeds=torch.randn(batch, 4, config.get("image_embed_dim", 1152), generator=generator),
    )
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


FAMILIES = (
    derived_family(
        "cogview4", CogView4Transformer2DModel, attention=(Attention,),
        variants={
            "6b": dict(patch_size=2, in_channels=16, num_layers=28, attention_head_dim=128, num_attention_heads=32,
                       out_channels=16, text_embed_dim=4096, time_embed_dim=512, condition_dim=256,
                       pos_embed_max_size=128),
        },
        sources="diffusers scripts/convert_cogview4_to_diffusers.py (CogView4-6B)",
        default_variant="6b",
        example_inputs=cogview4_inputs,
        test_configs={"tiny": dict(num_layers=2, attention_head_dim=8, num_attention_heads=4, in_channels=4,
                                   out_channels=4, text_embed_dim=16, time_embed_dim=16, condition_dim=8,
                                   pos_embed_max_size=16, sample_size=16, rope_axes_dim=(4, 4))},
    ),
    derived_family(
        "z-image", ZImageTransformer2DModel, attention=(Attention,),
        variants={
            "turbo": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                          n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True,
                          cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48],
                          axes_lens=[1024, 512, 512]),
        },
        sources="diffusers ZImageTransformer2DModel's defaults, the Tongyi-MAI/Z-Image-Turbo transformer "
        "(docs/source/en/api/models/z_image_transformer2d.md)",
        default_variant="turbo",
        example_inputs=z_image_inputs,
        test_configs={"tiny": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=48, n_layers=2,
                                   n_refiner_layers=1, n_heads=4, n_kv_heads=4, qk_norm=True, cap_feat_dim=16,
                                   axes_dims=[4, 4, 4], axes_lens=[256, 32, 32])},
    ),
    derived_family(
        "hunyuan-video-1.5", HunyuanVideo15Transformer3DModel, attention=(Attention,),
        variants={
            "480p-i2v": dict(target_size=640, task_type="i2v"),
            "720p-t2v": dict(target_size=960, task_type="t2v"),
            "720p-i2v": dict(target_size=960, task_type="i2v"),
            "480p-i2v-step-distilled": dict(target_size=640, task_type="i2v", use_meanflow=True),
        },
        sources="diffusers scripts/convert_hunyuan_video1_5_to_diffusers.py (TRANSFORMER_CONFIGS over the class "
        "defaults: 54 layers, 16 heads of 128)",
        default_variant="720p-t2v",
        example_inputs=hunyuan_video15_inputs,
        test_configs={"tiny": dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8,
                                   num_layers=2, num_refiner_layers=1, text_embed_dim=16, text_embed_2_dim=8,
                                   image_embed_dim=8, rope_axes_dim=(2, 2, 4))},
        replicated={HunyuanVideo15TokenRefiner: {
            "proj_in": "the text states' input projection, ahead of the refiner blocks (text tokens only, small)"}},
    ),
)
