"""Families derived from diffusers' building blocks whose processors reshape by the stored head count in the older
spelling (`head_dim = inner_dim // attn.heads`, `view(batch, -1, attn.heads, head_dim)`): the processor rule of
`surgery.core.leaves` reads it, so their rows are data only, like `rewrites/derived.py`: published configs with
their source, tiny test configs, example inputs.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import (
    Attention,
    AttnProcessor2_0,
    CogVideoXAttnProcessor2_0,
    HunyuanAttnProcessor2_0,
    JointAttnProcessor2_0,
    LuminaAttnProcessor2_0,
)
from diffusers.models.embeddings import get_3d_rotary_pos_embed
from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXTransformer3DModel
from diffusers.models.transformers.dit_transformer_2d import DiTTransformer2DModel
from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel
from diffusers.models.transformers.transformer_cogview3plus import CogView3PlusTransformer2DModel
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

from surgery.extend import derived_family


def _cast(inputs: dict, dtype: torch.dtype, device) -> dict:
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


def sd3_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `SD3Transformer2DModel.forward`: a square latent of `image_tokens` patches, text
    of `joint_attention_dim`, a pooled text embedding and a timestep."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), side, side, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("joint_attention_dim", 4096),
                                          generator=generator),
        pooled_projections=torch.randn(batch, config.get("pooled_projection_dim", 2048), generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
    )
    return _cast(inputs, dtype, device)


def cogvideox_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `CogVideoXTransformer3DModel.forward`: a latent video of `image_tokens` patches
    (frames of 2 x 2; a config with a learned positional embedding, which takes only its published grid, gets that
    grid), text of `text_embed_dim`, a timestep, and for a RoPE config (`use_rotary_positional_embeddings`) the 3D
    rotary cos/sin of its grid, as the pipeline computes them (one per token, head_dim wide)."""
    generator = torch.Generator().manual_seed(seed)
    p = config.get("patch_size", 2)
    if config.get("use_learned_positional_embeddings"):
        frames = (config.get("sample_frames", 49) - 1) // config.get("temporal_compression_ratio", 4) + 1
        rows, cols = config.get("sample_height", 60) // p, config.get("sample_width", 90) // p
    else:
        rows = cols = 2
        frames = max(1, image_tokens // (rows * cols))
    inputs = dict(
        hidden_states=torch.randn(batch, frames, config.get("in_channels", 16), rows * p, cols * p,
                                  generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_embed_dim", 4096), generator=generator),
        timestep=(torch.rand(batch, generator=generator) * 1000).long(),
    )
    inputs = _cast(inputs, dtype, device)
    if config.get("use_rotary_positional_embeddings"):
        cos, sin = get_3d_rotary_pos_embed(config.get("attention_head_dim", 64), ((0, 0), (rows, cols)), (rows, cols),
                                           frames)
        inputs["image_rotary_emb"] = (cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype))
    return inputs


def pixart_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `PixArtTransformer2DModel.forward`: a square latent of `image_tokens` patches,
    text of `caption_channels` with a padding mask (its last 2 tokens masked: the cross attention's mask path), a
    timestep, and resolution / aspect ratio where the config conditions on them (PixArt-alpha at 1024)."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[:, -2:] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 4), side, side, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("caption_channels") or 4096,
                                          generator=generator),
        timestep=(torch.rand(batch, generator=generator) * 1000).long(),
    )
    inputs = _cast(inputs, dtype, device)
    # an integer mask, as a tokenizer gives it: a float one would ask for its gradient, which on a rank is that of
    # its own heads only (the head-dim twin broadcasts one mask over the rank's heads)
    inputs["encoder_attention_mask"] = mask.to(device=device, dtype=torch.long)
    conditions = config.get("use_additional_conditions")
    if conditions is None:
        conditions = config.get("sample_size", 128) == 128
    resolution = torch.tensor([[float(side * 8)] * 2] * batch)
    inputs["added_cond_kwargs"] = ({"resolution": resolution.to(device=device, dtype=dtype),
                                    "aspect_ratio": torch.ones(batch, 1, device=device, dtype=dtype)}
                                   if conditions else {"resolution": None, "aspect_ratio": None})
    return inputs


def dit_inputs(config: dict, batch: int = 1, image_tokens: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", **_) -> dict:
    """Seeded keyword arguments for `DiTTransformer2DModel.forward`: a square latent of `image_tokens` patches, a
    timestep and an ImageNet class label (DiT is class-conditional: no text)."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 4), side, side, generator=generator),
        timestep=(torch.rand(batch, generator=generator) * 1000).long(),
        class_labels=torch.randint(0, config.get("num_embeds_ada_norm", 1000), (batch,), generator=generator),
    )
    return _cast(inputs, dtype, device)


def cogview3plus_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `CogView3PlusTransformer2DModel.forward`: a square latent of `image_tokens`
    patches, text of `text_embed_dim`, a timestep, and the size conditions (integer pixels, as the pipeline
    gives them)."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), side, side, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_embed_dim", 4096), generator=generator),
        timestep=(torch.rand(batch, generator=generator) * 1000).long(),
        original_size=torch.tensor([[side * 8, side * 8]] * batch),
        target_size=torch.tensor([[side * 8, side * 8]] * batch),
        crop_coords=torch.zeros(batch, 2, dtype=torch.long),
    )
    return _cast(inputs, dtype, device)


# diffusers' generic `Attention` lists no processors (each model sets its own); one rewrite of it for every family here
GENERIC = (AttnProcessor2_0, JointAttnProcessor2_0, CogVideoXAttnProcessor2_0, HunyuanAttnProcessor2_0,
           LuminaAttnProcessor2_0)

_SD3 = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=64,
            joint_attention_dim=4096, pooled_projection_dim=2048)
_SD3_TINY = dict(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                 num_attention_heads=4, joint_attention_dim=16, caption_projection_dim=32, pooled_projection_dim=16,
                 pos_embed_max_size=8)

FAMILIES = (
    derived_family(
        "sd3", SD3Transformer2DModel, attention=(Attention,), processors=GENERIC,
        variants={
            "sd3-medium": {**_SD3, "num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
                           "pos_embed_max_size": 192},
            "sd3.5-medium": {**_SD3, "num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
                             "pos_embed_max_size": 384, "qk_norm": "rms_norm",
                             "dual_attention_layers": tuple(range(13))},
            "sd3.5-large": {**_SD3, "num_layers": 38, "num_attention_heads": 38, "caption_projection_dim": 2432,
                            "pos_embed_max_size": 192, "qk_norm": "rms_norm"},
        },
        sources="transformer/config.json of stabilityai/stable-diffusion-3-medium-diffusers, "
        "stabilityai/stable-diffusion-3.5-medium and stabilityai/stable-diffusion-3.5-large (the values diffusers "
        "scripts/convert_sd3_to_diffusers.py reads off each checkpoint: heads = layers, caption_projection_dim from "
        "context_embedder, dual-attention layers, rms q/k norm)",
        default_variant="sd3.5-large",
        example_inputs=sd3_inputs,
        # the first test config is the one run sharded: SD3.5's, whose blocks hold SD3's and add q/k norms and a
        # second self-attention
        test_configs={"tiny_3.5": {**_SD3_TINY, "qk_norm": "rms_norm", "dual_attention_layers": (0,)},
                      "tiny": _SD3_TINY},
    ),
    derived_family(
        "cogvideox", CogVideoXTransformer3DModel, attention=(Attention,), processors=GENERIC,
        variants={
            "2b": {"num_layers": 30, "num_attention_heads": 30, "use_rotary_positional_embeddings": False},
            "5b": {"num_layers": 42, "num_attention_heads": 48, "use_rotary_positional_embeddings": True},
        },
        sources="diffusers scripts/convert_cogvideox_to_diffusers.py (--num_layers / --num_attention_heads / "
        "--use_rotary_positional_embeddings for CogVideoX-2b: 30 / 30 / no, CogVideoX-5b: 42 / 48 / yes; the rest "
        "get_transformer_init_kwargs('1.0') and the class defaults)",
        default_variant="5b",
        example_inputs=cogvideox_inputs,
        test_configs={
            "tiny": dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=16,
                         text_embed_dim=16, num_layers=2, sample_width=4, sample_height=4, sample_frames=5,
                         max_text_seq_length=8),
            # CogVideoX-5b's RoPE: sharded under no_grad only (tests/test_derived_joint.py): under autograd torch
            # refuses the processor's in-place write of the rotated q/k into the per-head norm's output (a view
            # DTensor's to_local returns). The 3D RoPE splits head_dim in quarters and eighths, each even: 16 at least
            "tiny_rope": dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
                              time_embed_dim=16, text_embed_dim=16, num_layers=2, sample_width=4, sample_height=4,
                              sample_frames=5, max_text_seq_length=8, use_rotary_positional_embeddings=True),
        },
    ),
    derived_family(
        "pixart", PixArtTransformer2DModel, attention=(Attention,), processors=GENERIC,
        variants={
            "alpha-1024": {"sample_size": 128, "caption_channels": 4096, "use_additional_conditions": True},
            "sigma-1024": {"sample_size": 128, "caption_channels": 4096, "use_additional_conditions": False,
                           "interpolation_scale": 2},
        },
        sources="transformer/config.json of PixArt-alpha/PixArt-XL-2-1024-MS and "
        "PixArt-alpha/PixArt-Sigma-XL-2-1024-MS (28 layers, 16 heads of 72, cross attention 1152: the class "
        "defaults; diffusers scripts/convert_pixart_alpha_to_diffusers.py, convert_pixart_sigma_to_diffusers.py)",
        default_variant="sigma-1024",
        example_inputs=pixart_inputs,
        test_configs={"tiny": dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=8,
                                   num_layers=2, cross_attention_dim=32, caption_channels=16, sample_size=8,
                                   use_additional_conditions=False)},
    ),
    derived_family(
        "dit", DiTTransformer2DModel, attention=(Attention,), processors=GENERIC,
        variants={"xl-2-256": {"sample_size": 32, "out_channels": 8}, "xl-2-512": {"sample_size": 64, "out_channels": 8}},
        sources="diffusers scripts/convert_dit_to_diffusers.py (DiT-XL-2-256 and DiT-XL-2-512: 28 layers, 16 heads of "
        "72, out_channels 8, sample_size image_size // 8)",
        default_variant="xl-2-256",
        example_inputs=dit_inputs,
        test_configs={"tiny": dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=8,
                                   num_layers=2, sample_size=8, num_embeds_ada_norm=10)},
    ),
    derived_family(
        "cogview3-plus", CogView3PlusTransformer2DModel, attention=(Attention,), processors=GENERIC,
        variants={"3b": {}},
        sources="diffusers scripts/convert_cogview3_to_diffusers.py (CogView3-Plus-3B: the class defaults, "
        "CogView3PlusTransformer2DModel())",
        default_variant="3b",
        example_inputs=cogview3plus_inputs,
        test_configs={"tiny": dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
                                   num_layers=2, text_embed_dim=16, time_embed_dim=16, condition_dim=4,
                                   pos_embed_max_size=8, sample_size=8)},
    ),
)
