"""The earlier DiTs (HunyuanDiT, Latte, Lumina-Next, EasyAnimate, OmniGen), derived from diffusers' building blocks
(`surgery.extend.derived_family`): one row per model class, data only (published configs with their source, tiny
test configs, example inputs). Their classes' defaults do not construct (`in_channels=None`, `patch_size=None`),
so only a published config builds them. Plans, rewrites and all-reduce counts are derived
(`surgery.parallel.derive`)."""

from __future__ import annotations

import math

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import get_2d_rotary_pos_embed
from diffusers.models.transformers.hunyuan_transformer_2d import HunyuanDiT2DModel, HunyuanDiTBlock
from diffusers.models.transformers.latte_transformer_3d import LatteTransformer3DModel
from diffusers.models.transformers.lumina_nextdit2d import LuminaNextDiT2DModel
from diffusers.models.transformers.transformer_easyanimate import EasyAnimateTransformer3DModel
from diffusers.models.transformers.transformer_omnigen import OmniGenTransformer2DModel

from surgery.extend import derived_family
from surgery_rewrites.derived_joint import GENERIC


def _cast(inputs: dict, dtype: torch.dtype, device) -> dict:
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) if isinstance(v, torch.Tensor)
            else v for k, v in inputs.items()}


def hunyuan_dit_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `HunyuanDiT2DModel.forward`: a square latent of `image_tokens` patches, both
    text streams (CLIP and T5, as long as the config's `text_len` / `text_len_t5`: the model pads them with its
    learned padding by mask, the last token of each masked), the size conditions and style of v1.0/v1.1, and the 2-D
    rotary table of the patch grid, computed as `HunyuanDiTPipeline` does (`text_tokens` is unused: the model's
    padding parameter fixes the text lengths)."""
    generator = torch.Generator().manual_seed(seed)
    grid = int(image_tokens ** 0.5)
    side = grid * config.get("patch_size", 2)
    head_dim = config.get("attention_head_dim", 88)
    clip, t5 = config.get("text_len", 77), config.get("text_len_t5", 256)
    mask, mask_t5 = torch.ones(batch, clip, dtype=torch.long), torch.ones(batch, t5, dtype=torch.long)
    mask[:, -1:] = 0
    mask_t5[:, -1:] = 0
    rotary = get_2d_rotary_pos_embed(head_dim, ((0, 0), (grid, grid)), (grid, grid), use_real=True)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 4), side, side, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, clip, config.get("cross_attention_dim", 1024), generator=generator),
        text_embedding_mask=mask,
        encoder_hidden_states_t5=torch.randn(batch, t5, config.get("cross_attention_dim_t5", 2048),
                                             generator=generator),
        text_embedding_mask_t5=mask_t5,
    )
    if config.get("use_style_cond_and_image_meta_size", True):  # v1.2 on reads neither
        inputs.update(image_meta_size=torch.tensor([[1024.0, 1024.0, 1024.0, 1024.0, 0.0, 0.0]] * batch),
                      style=torch.zeros(batch, dtype=torch.long))
    return {**_cast(inputs, dtype, device), "image_rotary_emb": tuple(t.to(device=device, dtype=dtype)
                                                                        for t in rotary)}


def latte_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `LatteTransformer3DModel.forward`: a video latent of `image_tokens` patches over
    the config's `video_length` frames (its temporal position table is that long), the T5 text, a timestep."""
    generator = torch.Generator().manual_seed(seed)
    frames = config.get("video_length", 16)
    per_frame = max(1, image_tokens // frames)
    height = max(d for d in range(1, math.isqrt(per_frame) + 1) if per_frame % d == 0)
    width = per_frame // height
    patch = config.get("patch_size", 2)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 4), frames, height * patch, width * patch,
                                  generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("caption_channels", 4096),
                                          generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
    )
    return {**_cast(inputs, dtype, device), "enable_temporal_attentions": True}


def easyanimate_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `EasyAnimateTransformer3DModel.forward`: a video latent of `image_tokens`
    patches (two frames), the Qwen2-VL text, a timestep, and for an inpainting config (more input channels than
    output) the inpaint latents that fill the rest of the input channels."""
    generator = torch.Generator().manual_seed(seed)
    frames = 2
    per_frame = max(1, image_tokens // frames)
    height = max(d for d in range(1, math.isqrt(per_frame) + 1) if per_frame % d == 0)
    width, patch = per_frame // height, config.get("patch_size", 2)
    latent = config.get("out_channels", 16)
    size = (frames, height * patch, width * patch)
    inputs = dict(
        hidden_states=torch.randn(batch, latent, *size, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_embed_dim", 3584),
                                          generator=generator),
    )
    if config.get("in_channels", latent) > latent:
        inputs["inpaint_latents"] = torch.randn(batch, config["in_channels"] - latent, *size, generator=generator)
    return _cast(inputs, dtype, device)


# the Tencent-Hunyuan/HunyuanDiT-Diffusers transformer's config.json (DiT-g/2), which diffusers'
# scripts/convert_hunyuandit_to_diffusers.py loads and edits only in `use_style_cond_and_image_meta_size`
_HUNYUAN_DIT = dict(num_attention_heads=16, attention_head_dim=88, in_channels=4, patch_size=2,
                    activation_fn="gelu-approximate", sample_size=128, hidden_size=1408, num_layers=40,
                    mlp_ratio=4.3637, learn_sigma=True, cross_attention_dim=1024, norm_type="layer_norm",
                    cross_attention_dim_t5=2048, pooled_projection_dim=1024, text_len=77, text_len_t5=256)

_HUNYUAN_DIT_TINY = dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, patch_size=2, sample_size=8,
                         hidden_size=32, mlp_ratio=2.0, cross_attention_dim=16, cross_attention_dim_t5=16,
                         pooled_projection_dim=8, text_len=4, text_len_t5=6, use_style_cond_and_image_meta_size=True)

# Phi-3's "su" rotary scaling factors, as diffusers scripts/convert_omnigen_to_diffusers.py passes them
_OMNIGEN_LONG_FACTOR = (1.0299999713897705, 1.0499999523162842, 1.0499999523162842, 1.0799999237060547,
    1.2299998998641968, 1.2299998998641968, 1.2999999523162842, 1.4499999284744263, 1.5999999046325684,
    1.6499998569488525, 1.8999998569488525, 2.859999895095825, 3.68999981880188, 5.419999599456787,
    5.489999771118164, 5.489999771118164, 9.09000015258789, 11.579999923706055, 15.65999984741211,
    15.769999504089355, 15.789999961853027, 18.360000610351562, 21.989999771118164, 23.079999923706055,
    30.009998321533203, 32.35000228881836, 32.590003967285156, 35.56000518798828, 39.95000457763672,
    53.840003967285156, 56.20000457763672, 57.95000457763672, 59.29000473022461, 59.77000427246094,
    59.920005798339844, 61.190006256103516, 61.96000671386719, 62.50000762939453, 63.3700065612793,
    63.48000717163086, 63.48000717163086, 63.66000747680664, 63.850006103515625, 64.08000946044922, 64.760009765625,
    64.80001068115234, 64.81001281738281, 64.81001281738281)
_OMNIGEN_SHORT_FACTOR = (1.05, 1.05, 1.05, 1.1, 1.1, 1.1, 1.2500000000000002, 1.2500000000000002, 1.4000000000000004,
    1.4500000000000004, 1.5500000000000005, 1.8500000000000008, 1.9000000000000008, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.1000000000000005, 2.1000000000000005, 2.2, 2.3499999999999996, 2.3499999999999996, 2.3499999999999996,
    2.3499999999999996, 2.3999999999999995, 2.3999999999999995, 2.6499999999999986, 2.6999999999999984,
    2.8999999999999977, 2.9499999999999975, 3.049999999999997, 3.049999999999997, 3.049999999999997)

FAMILIES = (
    derived_family(
        "hunyuan-dit", HunyuanDiT2DModel, attention=(Attention,), processors=GENERIC,
        variants={
            "v1.2": {**_HUNYUAN_DIT, "use_style_cond_and_image_meta_size": False},
            "v1.1": {**_HUNYUAN_DIT, "use_style_cond_and_image_meta_size": True},
        },
        sources="Tencent-Hunyuan/HunyuanDiT-v1.2-Diffusers and -v1.1-Diffusers transformer/config.json: the "
        "HunyuanDiT-Diffusers config (40 blocks of 16 heads x 88, mlp_ratio 4.3637) that diffusers "
        "scripts/convert_hunyuandit_to_diffusers.py loads, with use_style_cond_and_image_meta_size False from v1.2",
        default_variant="v1.2",
        example_inputs=hunyuan_dit_inputs,
        # "tiny" runs sharded; "tiny_skip"'s last block reads a long skip (`skip_linear`, whole on every rank), as
        # every block past the middle does (four blocks of fp32 noise through the skips exceed the gradient tolerance
        # at world 2, where float64 agrees to 1e-15)
        test_configs={
            "tiny": dict(_HUNYUAN_DIT_TINY, num_layers=2),
            "tiny_skip": dict(_HUNYUAN_DIT_TINY, num_layers=4, use_style_cond_and_image_meta_size=False),
        },
        replicated={HunyuanDiTBlock: {
            "skip_linear": "the long skip's projection reads a LayerNorm over cat([hidden, skip]) at full width "
            "(the residual stream every rank holds whole); one per block past the middle (19 of 40), 2 x 1408 -> 1408"}},
    ),
    derived_family(
        "latte", LatteTransformer3DModel, attention=(Attention,), processors=GENERIC,
        variants={"1": dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
                            num_layers=28, cross_attention_dim=1152, attention_bias=True, sample_size=64,
                            patch_size=2, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
                            norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
                            caption_channels=4096, video_length=16)},
        sources="maxin-cn/Latte-1 transformer/config.json (Latte-XL/2 for text-to-video: 28 spatial and 28 "
        "temporal blocks of 16 heads x 72, PixArt-alpha's T5 caption projection; diffusers' Latte pipeline docs)",
        default_variant="1",
        example_inputs=latte_inputs,
        test_configs={"tiny": dict(num_attention_heads=8, attention_head_dim=4, in_channels=4, out_channels=8,
                                   num_layers=2, cross_attention_dim=32, attention_bias=True, sample_size=8,
                                   patch_size=2, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
                                   norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
                                   caption_channels=16, video_length=2)},
    ),
    derived_family(
        "lumina-next", LuminaNextDiT2DModel, attention=(Attention,), processors=GENERIC,
        variants={"sft": dict(sample_size=128, patch_size=2, in_channels=4, hidden_size=2304, num_layers=24,
                              num_attention_heads=32, num_kv_heads=8, multiple_of=256, ffn_dim_multiplier=None,
                              norm_eps=1e-5, learn_sigma=True, qk_norm=True, cross_attention_dim=2048,
                              scaling_factor=1.0)},
        sources="diffusers scripts/convert_lumina_to_diffusers.py (Alpha-VLLM/Lumina-Next-SFT-diffusers)",
        default_variant="sft",
    ),
    derived_family(
        "easyanimate", EasyAnimateTransformer3DModel, attention=(Attention,),
        variants={
            "v5.1-12b": dict(in_channels=16, out_channels=16, patch_size=2),
            "v5.1-12b-inp": dict(in_channels=33, out_channels=16, patch_size=2),
        },
        sources="alibaba-pai/EasyAnimateV5.1-12b-zh(-InP)-diffusers transformer/config.json: diffusers' "
        "EasyAnimateTransformer3DModel defaults (48 MMDiT blocks of 48 heads x 64, Qwen2-VL text 3584) with the "
        "latent channels (16; 33 with the inpaint latents) and patch size 2 that the defaults leave unset",
        default_variant="v5.1-12b",
        example_inputs=easyanimate_inputs,
        test_configs={"tiny": dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
                                   patch_size=2, num_layers=2, mmdit_layers=2, text_embed_dim=16,
                                   time_embed_dim=16, sample_height=16, sample_width=16)},
    ),
    derived_family(
        "omnigen", OmniGenTransformer2DModel, attention=(Attention,),
        variants={"v1": dict(rope_scaling=dict(long_factor=list(_OMNIGEN_LONG_FACTOR),
                                               short_factor=list(_OMNIGEN_SHORT_FACTOR), type="su"),
                             patch_size=2, in_channels=4, pos_embed_max_size=192)},
        sources="diffusers scripts/convert_omnigen_to_diffusers.py (Shitao/OmniGen-v1-diffusers: Phi-3-mini's 32 "
        "layers of 32 heads x 96 from the class defaults)",
        default_variant="v1",
    ),
)
