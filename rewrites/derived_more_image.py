"""More DiTs derived from diffusers' building blocks (`surgery.extend.derived_family`): one row per model class, data
only (published configs with their source, tiny test configs, example inputs for the forwards that take more than a
latent and a text). Plans, rewrites (head-dim twins of the processors) and all-reduce counts are derived
(`surgery.parallel.derive`); the adaptive norms' Linears stay whole by the general rule of
`surgery.parallel.plans.replicated_reason`."""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import (
    AllegroAttnProcessor2_0,
    Attention,
    AuraFlowAttnProcessor2_0,
    FusedAuraFlowAttnProcessor2_0,
)
from diffusers.models.transformers import transformer_anyflow as anyflow
from diffusers.models.transformers.prior_transformer import PriorTransformer
from diffusers.models.transformers.transformer_allegro import AllegroTransformer3DModel
from diffusers.models.transformers.transformer_ernie_image import (
    ErnieImageAttention,
    ErnieImageSingleStreamAttnProcessor,
    ErnieImageTransformer2DModel,
)
from diffusers.models.transformers.transformer_glm_image import GlmImageTransformer2DModel
from diffusers.models.transformers.auraflow_transformer_2d import AuraFlowTransformer2DModel
from diffusers.models.transformers.transformer_hunyuan_video_framepack import (
    FramepackClipVisionProjection,
    HunyuanVideoFramepackTransformer3DModel,
)
from diffusers.models.transformers.consisid_transformer_3d import (
    ConsisIDTransformer3DModel,
    LocalFacialExtractor,
    PerceiverCrossAttention,
)

from surgery.extend import derived_family
from surgery_rewrites.derived import _WAN, _WAN_TINY
from surgery_rewrites.derived_joint import GENERIC, cogvideox_inputs
from surgery_rewrites.hunyuan_video import REWRITES as HUNYUAN_VIDEO_REWRITES
from surgery_rewrites.hunyuan_video import example_inputs as hunyuan_video_inputs


def _cast(inputs: dict, dtype: torch.dtype, device) -> dict:
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


def auraflow_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `AuraFlowTransformer2DModel.forward`: a square latent of `image_tokens` patches,
    the UMT5 text of `joint_attention_dim` and a timestep."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 4), side, side, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("joint_attention_dim", 2048),
                                          generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
    )
    return _cast(inputs, dtype, device)


FAMILIES = (
    derived_family(
        "auraflow", AuraFlowTransformer2DModel, attention=(Attention,),
        processors=(AuraFlowAttnProcessor2_0, FusedAuraFlowAttnProcessor2_0),
        variants={
            # 4 joint (MMDiT) blocks, 32 single ones, 12 heads of 256, UMT5-XL text (2048): the class defaults
            "v0.1": {},
            "v0.3": {"pos_embed_max_size": 9216},
        },
        sources="transformer/config.json of fal/AuraFlow (v0.1, the class defaults; diffusers scripts/"
        "convert_aura_flow_to_diffusers.py builds AuraFlowTransformer2DModel(num_mmdit_layers=4, "
        "num_single_dit_layers=32) over them) and fal/AuraFlow-v0.3 (the same with pos_embed_max_size 9216 for its "
        "aspect ratios, as p1atdev/vision-ft's DEFAULT_DENOISER_CONFIG reads it)",
        default_variant="v0.3",
        example_inputs=auraflow_inputs,
        test_configs={"tiny": dict(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1,
                                   num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=4,
                                   caption_projection_dim=32, joint_attention_dim=16, out_channels=4,
                                   pos_embed_max_size=16)},
    ),
)


def consisid_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """`cogvideox_inputs` (text padded to `max_text_seq_length`, which the learned positional embedding of an
    image-to-video config reads) plus, where the config trains the face path (`is_train_face`), the face: its ID
    embedding and the ViT hidden states of `LFE_num_scale` scales (577 tokens of `LFE_vit_dim` at full size)."""
    text = config.get("max_text_seq_length", 226) if config.get("use_learned_positional_embeddings") else text_tokens
    inputs = cogvideox_inputs(config, batch=batch, image_tokens=image_tokens, text_tokens=text, seed=seed,
                              dtype=dtype, device=device)
    if config.get("is_train_face"):
        generator = torch.Generator().manual_seed(seed + 1)
        inputs["id_cond"] = torch.randn(batch, config.get("LFE_id_dim", 1280), generator=generator).to(device, dtype)
        inputs["id_vit_hidden"] = [
            torch.randn(batch, 5, config.get("LFE_vit_dim", 1024), generator=generator).to(device, dtype)
            for _ in range(config.get("LFE_num_scale", 5))]
    return inputs


FACE = ("ConsisID's face path: the facial extractor reads the face once per forward (a few dozen tokens), and its "
        "cross attentions' `to_kv` holds k and v rows fused and their forward splits heads by the stored count; every "
        "rank holds them whole")

FAMILIES += (
    derived_family(
        "consisid", ConsisIDTransformer3DModel, attention=(Attention,), processors=GENERIC,
        variants={
            "preview": dict(num_attention_heads=48, attention_head_dim=64, in_channels=32, out_channels=16,
                            num_layers=42, use_rotary_positional_embeddings=True,
                            use_learned_positional_embeddings=True, is_train_face=True, is_kps=False),
        },
        sources="BestWishYsh/ConsisID-preview transformer/config.json: CogVideoX-5B-I2V's transformer (diffusers "
        "scripts/convert_cogvideox_to_diffusers.py: 42 layers, 48 heads of 64, image latents concatenated: 32 input "
        "channels, RoPE and learned positional embeddings) with the face modules at the class defaults "
        "(cross attention every 2nd block, 16 heads of 128; the facial extractor's 10 layers) and is_train_face on",
        default_variant="preview",
        example_inputs=consisid_inputs,
        # the face cross attention reads LFE_output_dim = 2/3 of the model width: heads of 12. 16 face queries: with 2,
        # its q gradient is a difference of near-equal terms, 4e-5 apart between two fp32 summation orders
        test_configs={"tiny": dict(num_attention_heads=4, attention_head_dim=12, in_channels=4, out_channels=4,
                                   time_embed_dim=16, text_embed_dim=16, num_layers=2, sample_width=4,
                                   sample_height=4, sample_frames=5, max_text_seq_length=8, is_train_face=True,
                                   is_kps=False, cross_attn_interval=1, cross_attn_dim_head=8, cross_attn_num_heads=2,
                                   LFE_id_dim=8, LFE_vit_dim=8, LFE_depth=2, LFE_dim_head=8, LFE_num_heads=2,
                                   LFE_num_id_token=2, LFE_num_querie=16, LFE_output_dim=32, LFE_ff_mult=1,
                                   LFE_num_scale=2)},
        replicated={PerceiverCrossAttention: {"to_*": FACE}, LocalFacialExtractor: {"*": FACE}},
    ),
)


def framepack_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """HunyuanVideo's inputs (`surgery_rewrites.hunyuan_video.example_inputs`) plus what FramePack's sampler adds:
    the SigLIP image embedding (where the config projects one), the frame index of each latent frame and its
    three histories (clean latents at full resolution, 2x and 4x coarser ones, which its history embedder patches
    with 2x and 4x larger kernels) with their frame indices."""
    inputs = hunyuan_video_inputs(config, batch=batch, image_tokens=image_tokens, text_tokens=text_tokens, seed=seed,
                                  dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(seed + 1)
    video = inputs["hidden_states"]
    frames, size = video.shape[2], video.shape[3:]

    def latent(count: int) -> torch.Tensor:
        return torch.randn(batch, video.shape[1], count, *size, generator=generator).to(device, dtype)

    extra = dict(indices_latents=torch.arange(2, 2 + frames))
    if config.get("has_image_proj"):
        extra["image_embeds"] = torch.randn(batch, 4, config.get("image_proj_dim", 1152),
                                            generator=generator).to(device, dtype)
    if config.get("has_clean_x_embedder"):
        extra |= dict(latents_clean=latent(1), indices_latents_clean=torch.arange(1),
                      latents_history_2x=latent(2), indices_latents_history_2x=torch.arange(2, 4) + frames,
                      latents_history_4x=latent(4), indices_latents_history_4x=torch.arange(4, 8) + frames)
    return {**inputs, **{k: v.to(device) for k, v in extra.items()}}


FAMILIES += (
    # its blocks are HunyuanVideo's: the hunyuan-video family's rewrites and plans (surgery_rewrites.hunyuan_video)
    # apply to them as they are
    derived_family(
        "hunyuan-video-framepack", HunyuanVideoFramepackTransformer3DModel, rewrites=HUNYUAN_VIDEO_REWRITES,
        variants={
            "i2v": dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                        num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                        qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                        rope_theta=256.0, rope_axes_dim=(16, 56, 56), image_condition_type=None,
                        has_image_proj=True, image_proj_dim=1152, has_clean_x_embedder=True),
        },
        sources="lllyasviel/FramePackI2V_HY transformer/config.json (diffusers' FramePack docs load it into "
        "HunyuanVideoFramepackTransformer3DModel: HunyuanVideo's 20 + 40 blocks of 24 heads of 128, the SigLIP "
        "image projection of 1152 and the history embedder)",
        default_variant="i2v",
        example_inputs=framepack_inputs,
        test_configs={"tiny": dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8,
                                   num_layers=1, num_single_layers=1, num_refiner_layers=1, text_embed_dim=16,
                                   pooled_projection_dim=8, rope_axes_dim=(2, 2, 4), has_image_proj=True,
                                   image_proj_dim=16, has_clean_x_embedder=True)},
        replicated={FramepackClipVisionProjection: dict.fromkeys(
            ("up", "down"), "the SigLIP image embedding's projection ahead of the blocks (a few image tokens)")},
    ),
)


def allegro_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `AllegroTransformer3DModel.forward`: two latent frames of `image_tokens / 2`
    patches, the T5 text of `caption_channels` with its padding mask (the last two tokens padding: the cross
    attention's mask path runs) and a timestep. No rotary tables: the pipeline computes them; the processor applies
    them per head, after its head split."""
    generator = torch.Generator().manual_seed(seed)
    p = config.get("patch_size", 2)
    height = max(d for d in range(1, int((image_tokens // 2) ** 0.5) + 1) if (image_tokens // 2) % d == 0)
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[:, -2:] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 4), 2, height * p, image_tokens // 2 // height * p,
                                  generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("caption_channels", 4096),
                                          generator=generator),
        timestep=(torch.rand(batch, generator=generator) * 1000).long(),
    )
    return {**_cast(inputs, dtype, device), "encoder_attention_mask": mask.to(device)}


FAMILIES += (
    derived_family(
        "allegro", AllegroTransformer3DModel, attention=(Attention,), processors=(AllegroAttnProcessor2_0,),
        variants={"t2v": {}},
        sources="rhymes-ai/Allegro transformer/config.json: the class defaults (32 layers, 24 heads of 96, cross "
        "attention 2304 over T5-XXL's 4096; diffusers docs/source/en/api/models/allegro_transformer3d.md loads it)",
        default_variant="t2v",
        example_inputs=allegro_inputs,
        # heads x head size a multiple of 16 (its 3D sin-cos positional embedding)
        test_configs={"tiny": dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
                                   num_layers=2, cross_attention_dim=32, sample_width=8, sample_height=8,
                                   sample_frames=8, caption_channels=16)},
    ),
)


def glm_image_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `GlmImageTransformer2DModel.forward`: a square latent of `image_tokens` patches,
    the glyph text features of `text_embed_dim` with a padding mask (the last two tokens padding), the
    autoregressive prior's token per patch (none dropped), a timestep and the size conditions."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5)
    p = config.get("patch_size", 2)
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[:, -2:] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), side * p, side * p, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_embed_dim", 1472),
                                          generator=generator),
        prior_token_id=torch.randint(0, config.get("prior_vq_quantizer_codebook_size", 16384),
                                     (batch, side * side), generator=generator),
        prior_token_drop=torch.zeros(batch, dtype=torch.bool),
        timestep=(torch.rand(batch, generator=generator) * 1000).long(),
        target_size=torch.tensor([[side * p * 8.0] * 2] * batch),
        crop_coords=torch.zeros(batch, 2),
    )
    return {**_cast(inputs, dtype, device), "attention_mask": mask.to(device)}


FAMILIES += (
    derived_family(
        "glm-image", GlmImageTransformer2DModel, attention=(Attention,),
        variants={"base": {}},
        sources="zai-org/GLM-Image transformer/config.json: the class defaults (30 layers, 64 heads of 40, glyph text "
        "1472, the AR prior's 16384-token codebook; diffusers docs/source/en/api/pipelines/glm_image.md loads it)",
        default_variant="base",
        example_inputs=glm_image_inputs,
        test_configs={"tiny": dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                                   num_attention_heads=4, text_embed_dim=32, time_embed_dim=16, condition_dim=8,
                                   prior_vq_quantizer_codebook_size=64)},
    ),
)


def ernie_image_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `ErnieImageTransformer2DModel.forward`: a square latent of `image_tokens`
    patches, the text features of `text_in_dim` padded to `text_tokens` with each sample's length (the second
    sample two tokens shorter: the padding mask's path runs) and a timestep."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 1)
    lengths = torch.tensor([text_tokens - 2 * (i % 2) for i in range(batch)])
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 128), side, side, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        text_bth=torch.randn(batch, text_tokens, config.get("text_in_dim", 2560), generator=generator),
    )
    return {**_cast(inputs, dtype, device), "text_lens": lengths.to(device)}


_ERNIE_IMAGE = dict(hidden_size=4096, num_attention_heads=32, num_layers=36, ffn_hidden_size=12288, in_channels=128,
                    out_channels=128, patch_size=1, text_in_dim=3072, rope_theta=256, rope_axes_dim=(32, 48, 48),
                    eps=1e-6, qk_layernorm=True)

FAMILIES += (
    derived_family(
        "ernie-image", ErnieImageTransformer2DModel, attention=(ErnieImageAttention,),
        processors=(ErnieImageSingleStreamAttnProcessor,),
        variants={"base": _ERNIE_IMAGE, "turbo": _ERNIE_IMAGE},
        sources="baidu/ERNIE-Image and baidu/ERNIE-Image-Turbo transformer/config.json (36 layers, 32 heads of 128, "
        "SwiGLU-like feed-forward of 12288, text 3072; the Turbo config adds LoRA fields the class ignores)",
        default_variant="base",
        example_inputs=ernie_image_inputs,
        test_configs={"tiny": dict(hidden_size=32, num_attention_heads=4, num_layers=2, ffn_hidden_size=48,
                                   in_channels=8, out_channels=8, patch_size=1, text_in_dim=16,
                                   rope_axes_dim=(4, 2, 2))},
    ),
)


def anyflow_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `AnyFlowTransformer3DModel.forward`: a video latent laid out frames first,
    `[batch, frames, channels, h, w]`, of `image_tokens` patches in two frames; the flow map's two times per frame
    (`timestep` t and `r_timestep` r < t); the text."""
    generator = torch.Generator().manual_seed(seed)
    p_t, p_h, p_w = config.get("patch_size", (1, 2, 2))
    frames = 2
    per_frame = image_tokens // frames
    height = max(d for d in range(1, int(per_frame ** 0.5) + 1) if per_frame % d == 0)
    t = torch.rand(batch, 1, generator=generator).expand(batch, frames) * 1000
    inputs = dict(
        hidden_states=torch.randn(batch, frames * p_t, config.get("in_channels", 16), height * p_h,
                                  per_frame // height * p_w, generator=generator),
        timestep=t.contiguous(), r_timestep=(t * 0.5).contiguous(),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_dim", 4096), generator=generator),
    )
    return _cast(inputs, dtype, device)


# Wan2.1-T2V's transformer/config.json (diffusers scripts/convert_wan_to_diffusers.py) as AnyFlow's conversion loads
# it, less the keys the AnyFlow classes do not take (qk_norm: their q/k norms are always across heads)
_ANYFLOW = {**{k: v for k, v in _WAN.items() if k != "qk_norm"}, "in_channels": 16, "gate_value": 0.25,
            "deltatime_type": "r"}
_ANYFLOW_1_3B = {**_ANYFLOW, "ffn_dim": 8960, "num_attention_heads": 12, "num_layers": 30}
_ANYFLOW_14B = {**_ANYFLOW, "ffn_dim": 13824, "num_attention_heads": 40, "num_layers": 40}
# heads of 12, as diffusers' AnyFlow tests: the 3D rotary table splits head_dim in three even parts
_ANYFLOW_TINY = {**{k: v for k, v in _WAN_TINY.items() if k != "freq_dim"}, "attention_head_dim": 12,
                 "freq_dim": 256, "gate_value": 0.25, "deltatime_type": "r"}

# AnyFlowFARTransformer3DModel (the causal, frame-autoregressive one) has no row: its attention is flex_attention
# with a block mask, which has no backward on CPU (and compiles under a TorchDispatchMode, the collective counter),
# so the conformance suite cannot prove it on the CPU ranks the tests run on
FAMILIES += (
    derived_family(
        "anyflow", anyflow.AnyFlowTransformer3DModel, attention=(anyflow.AnyFlowAttention,),
        variants={"wan2.1-t2v-1.3b": _ANYFLOW_1_3B, "wan2.1-t2v-14b": _ANYFLOW_14B},
        sources="diffusers scripts/convert_anyflow_to_diffusers.py (VARIANTS: AnyFlow-Wan2.1-T2V-1.3B/14B-Diffusers "
        "load Wan-AI/Wan2.1-T2V-1.3B/14B-Diffusers' transformer config with gate_value=0.25, deltatime_type='r'; "
        "those configs: scripts/convert_wan_to_diffusers.py)",
        default_variant="wan2.1-t2v-14b",
        example_inputs=anyflow_inputs,
        test_configs={"tiny": _ANYFLOW_TINY},
    ),
)


def prior_inputs(config: dict, batch: int = 1, text_tokens: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", **_) -> dict:
    """Seeded keyword arguments for `PriorTransformer.forward` (an unCLIP prior: it denoises one CLIP image
    embedding, no image tokens): the noisy embedding, a timestep, the CLIP text embedding (`proj_embedding`), and
    where the config projects them (`encoder_hid_proj_type`), the text encoder's `num_embeddings` hidden states with
    their mask (the last two tokens padding: the causal mask plus padding path runs)."""
    generator = torch.Generator().manual_seed(seed)
    width = config.get("embedding_dim", 768)
    tokens = config.get("num_embeddings", 77)
    inputs = dict(
        hidden_states=torch.randn(batch, width, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        proj_embedding=torch.randn(batch, config.get("embedding_proj_dim") or width, generator=generator),
    )
    if config.get("encoder_hid_proj_type", "linear") is not None:
        inputs["encoder_hidden_states"] = torch.randn(batch, tokens, width, generator=generator)
    inputs = _cast(inputs, dtype, device)
    if "encoder_hidden_states" in inputs:
        mask = torch.ones(batch, tokens, dtype=torch.bool)
        mask[:, -2:] = False
        inputs["attention_mask"] = mask.to(device)
    return inputs


_SHAP_E = dict(num_layers=24, embedding_dim=1024, num_embeddings=1024, additional_embeddings=0,
               time_embed_act_fn="gelu", norm_in_type="layer", encoder_hid_proj_type=None, added_emb_type=None,
               time_embed_dim=4096, clip_embed_dim=2048)

FAMILIES += (
    derived_family(
        "prior", PriorTransformer, attention=(Attention,), processors=GENERIC,
        variants={
            "kandinsky-2.2": {},
            "shap-e": {**_SHAP_E, "num_attention_heads": 16, "attention_head_dim": 64, "embedding_proj_dim": 768},
            "shap-e-img2img": {**_SHAP_E, "num_attention_heads": 8, "attention_head_dim": 128,
                               "embedding_proj_dim": 1024, "embedding_proj_norm_type": "layer"},
        },
        sources="diffusers scripts/convert_kandinsky_to_diffusers.py (PRIOR_CONFIG: the class defaults, 20 layers of "
        "32 heads of 64 over CLIP ViT-L's 768: kandinsky-community/kandinsky-2-1-prior and -2-2-prior) and "
        "scripts/convert_shap_e_to_diffusers.py (PRIOR_CONFIG, PRIOR_IMAGE_CONFIG: openai/shap-e, shap-e-img2img)",
        default_variant="kandinsky-2.2",
        example_inputs=prior_inputs,
        test_configs={"tiny": dict(num_attention_heads=4, attention_head_dim=8, num_layers=2, embedding_dim=32,
                                   num_embeddings=7, additional_embeddings=4)},
    ),
)
