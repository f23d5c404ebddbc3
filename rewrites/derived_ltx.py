"""LTX-Video, LTX-2 and SANA-WM's LTX-2 refiner as derived families (`surgery.extend.derived_family`): published
configs with their source, tiny test configs, example inputs.

Their processors rotate q and k across the whole attention width before splitting heads, so each family row names the
attention's rotary arguments (`rotary=`): the derived plan hands each rank its heads' share of the tables
(`surgery.parallel.derive.RotaryAcrossWidth`; LTX-2's "split" tables `[batch, heads, tokens, head_dim / 2]` by their
heads, the "interleaved" ones `[batch, tokens, width]` by their width). The rest is derived: head-dim twins of the
processors, q/k norms across heads by their statistic, LTX-2's per-head gates (`to_gate_logits`) colwise with the
heads, the feed-forwards' shared plan.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from diffusers.models.transformers.transformer_ltx import LTXAttention, LTXVideoTransformer3DModel
from diffusers.models.transformers.transformer_ltx2 import LTX2Attention, LTX2VideoTransformer3DModel
from diffusers.models.transformers.transformer_sana_wm_refiner import (
    SanaWMLTX2Attention,
    SanaWMLTX2AudioVideoAttnProcessor,
    SanaWMLTX2AudioVideoRotaryPosEmbed,
    SanaWMLTX2PerturbedAttnProcessor,
    SanaWMLTX2RefinerAttnProcessor,
)
from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMLTX2RefinerTransformer3DModel

from surgery.extend import derived_family
from surgery_rewrites.hunyuan_video import video_grid


def _text(generator: torch.Generator, batch: int, tokens: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Text embeddings and their boolean mask (the pipelines' tokenizer mask), the last two tokens of the second sample
    padding (the mask path runs)."""
    mask = torch.ones(batch, tokens, dtype=torch.bool)
    if batch > 1 and tokens > 2:
        mask[1, -2:] = False
    return torch.randn(batch, tokens, width, generator=generator), mask


def ltx_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `LTXVideoTransformer3DModel.forward`: `image_tokens` patchified latent tokens on
    a frames x height x width grid, the pipeline's RoPE interpolation scale (VAE strides over 25 fps)."""
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = video_grid(image_tokens)
    text, mask = _text(generator, batch, text_tokens, config.get("caption_channels", 4096))
    inputs = dict(
        hidden_states=torch.randn(batch, frames * height * width, config.get("in_channels", 128), generator=generator),
        encoder_hidden_states=text,
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_attention_mask=mask,
    )
    inputs = {k: v.to(device=device, dtype=dtype if k != "encoder_attention_mask" else v.dtype)
              for k, v in inputs.items()}
    return {**inputs, "num_frames": frames, "height": height, "width": width,
            "rope_interpolation_scale": (8 / 25, 32, 32)}


def ltx2_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `LTX2VideoTransformer3DModel.forward`: `image_tokens` video tokens on a frames x
    height x width grid, half as many audio tokens, one text sequence per modality; the noise levels (`sigma`) a
    config with prompt modulation (LTX-2.3) reads."""
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = video_grid(image_tokens)
    audio_frames = max(image_tokens // 2, 1)
    # the Gemma features its caption projections read, or (LTX-2.3: no projection) the connectors' outputs, as wide as
    # each modality's cross-attention input
    projected = config.get("use_prompt_embeddings", True)
    video_text = config.get("caption_channels", 3840) if projected else config.get("cross_attention_dim", 4096)
    audio_text = config.get("caption_channels", 3840) if projected else config.get("audio_cross_attention_dim", 2048)
    text, mask = _text(generator, batch, text_tokens, video_text)
    timestep = torch.rand(batch, generator=generator)
    inputs = dict(
        hidden_states=torch.randn(batch, frames * height * width, config.get("in_channels", 128), generator=generator),
        audio_hidden_states=torch.randn(batch, audio_frames, config.get("audio_in_channels", 128),
                                        generator=generator),
        encoder_hidden_states=text,
        audio_encoder_hidden_states=torch.randn(batch, text_tokens, audio_text, generator=generator),
        timestep=timestep * 1000,
        sigma=timestep,
        encoder_attention_mask=mask,
        audio_encoder_attention_mask=mask.clone(),
    )
    inputs = {k: v.to(device=device, dtype=dtype if "mask" not in k else v.dtype) for k, v in inputs.items()}
    return {**inputs, "num_frames": frames, "height": height, "width": width, "audio_num_frames": audio_frames,
            "fps": 25.0}


def sana_wm_refiner_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                           dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `SanaWMLTX2RefinerTransformer3DModel.forward` (its video stream only): the video
    tokens of one block, text for its caption projection, and the RoPE tables the caller supplies, built as the model's
    own `rope` builds them (`build_rotary_emb_for_absolute_positions` of frames 0..)."""
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = video_grid(image_tokens)
    text, mask = _text(generator, batch, text_tokens, config.get("caption_channels", 3840))
    inputs = dict(
        hidden_states=torch.randn(batch, frames * height * width, config.get("in_channels", 128), generator=generator),
        encoder_hidden_states=text,
        timestep=torch.rand(batch, generator=generator) * 1000,
    )
    inputs = {k: v.to(device=device, dtype=dtype) for k, v in inputs.items()}
    rope = SanaWMLTX2AudioVideoRotaryPosEmbed(
        dim=config.get("num_attention_heads", 32) * config.get("attention_head_dim", 128),
        base_num_frames=config.get("pos_embed_max_pos", 20), scale_factors=config.get("vae_scale_factors", (8, 32, 32)),
        theta=config.get("rope_theta", 10000.0), double_precision=config.get("rope_double_precision", True),
        rope_type=config.get("rope_type", "interleaved"), num_attention_heads=config.get("num_attention_heads", 32))
    tables = SanaWMLTX2RefinerTransformer3DModel.build_rotary_emb_for_absolute_positions(
        SimpleNamespace(rope=rope), batch, list(range(frames)), height, width, device, fps=25.0)
    return {**inputs, "encoder_attention_mask": mask.to(device), "video_rotary_emb": tables}


_LTX = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
            activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads", norm_elementwise_affine=False,
            norm_eps=1e-6, caption_channels=4096, attention_bias=True, attention_out_bias=True)
# cross_attention_dim is the width the caption projection gives: the model's own (heads x head_dim). The configs the
# suite shards hold one block: from the second block on, these seeded models' q/k gradients are ill-conditioned in
# fp32 (a 1e-7 relative perturbation of the weights moves them by up to 2e-5 (LTX-Video) and 6e-5 (LTX-2), measured),
# so any change of summation order exceeds the gradient tolerance; tests/test_derived_ltx.py shards two blocks in
# float64 instead.
_LTX_TINY = dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
                 num_layers=1, caption_channels=16)

_LTX2 = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
             attention_head_dim=128, cross_attention_dim=4096, vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20,
             base_height=2048, base_width=2048, audio_in_channels=128, audio_out_channels=128, audio_patch_size=1,
             audio_patch_size_t=1, audio_num_attention_heads=32, audio_attention_head_dim=64,
             audio_cross_attention_dim=2048, audio_scale_factor=4, audio_pos_embed_max_pos=20,
             audio_sampling_rate=16000, audio_hop_length=160, num_layers=48, activation_fn="gelu-approximate",
             qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=3840,
             attention_bias=True, attention_out_bias=True, rope_theta=10000.0, rope_double_precision=True,
             causal_offset=1, timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000,
             rope_type="split")
_LTX2_3 = dict(gated_attn=True, cross_attn_mod=True, audio_gated_attn=True, audio_cross_attn_mod=True,
               use_prompt_embeddings=False, perturbed_attn=True)
# audio_cross_attention_dim is the audio attention's width (a2v keys, the cross-modal rotary tables); 4 heads each,
# so the tiny models split at world 2 and 4
_LTX2_TINY = dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
                  audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=4, audio_attention_head_dim=8,
                  audio_cross_attention_dim=32, num_layers=2, caption_channels=16, rope_type="split")
# The configs the suite shards in fp32: one block, heads of 16, no attention biases. The seeded biases (about 1 each)
# dominate q and k, whose norm across heads then cancels most of them, and heads of 4 or 8 average little: the q/k
# gradients moved by up to 1.1e-5 under a mere change of summation order (measured at world 2); so configured, at
# most 3.3e-6 over the seeds tried. The biased two-block configs shard in float64 (tests/test_derived_ltx.py).
_LTX2_WIDE = dict(attention_head_dim=16, cross_attention_dim=64, audio_attention_head_dim=16,
                  audio_cross_attention_dim=64)
_LTX2_TP = {**_LTX2_TINY, **_LTX2_3, **_LTX2_WIDE, "num_layers": 1, "attention_bias": False}

FAMILIES = (
    derived_family(
        "ltx-video", LTXVideoTransformer3DModel, attention=(LTXAttention,),
        variants={
            "2b": {**_LTX, "attention_head_dim": 64, "cross_attention_dim": 2048, "num_layers": 28},
            "13b": {**_LTX, "attention_head_dim": 128, "cross_attention_dim": 4096, "num_layers": 48},
        },
        sources="diffusers scripts/convert_ltx_to_diffusers.py (get_transformer_config: LTX-Video 0.9.0-0.9.6 2B, "
        "0.9.7+ 13B)",
        default_variant="13b",
        example_inputs=ltx_inputs,
        test_configs={"tiny": _LTX_TINY, "tiny_2_blocks": {**_LTX_TINY, "num_layers": 2}},
        rotary={LTXAttention: ("image_rotary_emb",)},
    ),
    derived_family(
        "ltx-2", LTX2VideoTransformer3DModel, attention=(LTX2Attention,),
        variants={
            "2.0": {**_LTX2, "gated_attn": False, "cross_attn_mod": False, "audio_gated_attn": False,
                    "audio_cross_attn_mod": False, "use_prompt_embeddings": True, "perturbed_attn": False},
            "2.3": {**_LTX2, **_LTX2_3},
            "2.5": {**_LTX2, **_LTX2_3, "ff_bias": False, "use_keyframes_abs_pos_embedding": True},
        },
        sources="diffusers scripts/convert_ltx2_to_diffusers.py (get_ltx2_transformer_config: Lightricks/LTX-2, "
        "Lightricks/LTX-2.3, Lightricks/LTX-2.5)",
        default_variant="2.3",
        example_inputs=ltx2_inputs,
        # the first runs sharded in the conformance suite: LTX-2.3's gated, perturbed attention with split RoPE
        # tables; the two-block ones (with attention biases, both RoPE layouts) in tests/test_derived_ltx.py
        test_configs={"tiny": _LTX2_TP, "tiny_2.3": {**_LTX2_TINY, **_LTX2_3},
                      "tiny_2.0_interleaved": {**_LTX2_TINY, "rope_type": "interleaved"}},
        rotary={LTX2Attention: ("query_rotary_emb", "key_rotary_emb")},
    ),
    derived_family(
        "sana-wm-refiner", SanaWMLTX2RefinerTransformer3DModel, attention=(SanaWMLTX2Attention,),
        # the refiner sets its own self-attention processor (sliding-window KV cache), not among the class's listed
        processors=(SanaWMLTX2AudioVideoAttnProcessor, SanaWMLTX2PerturbedAttnProcessor,
                    SanaWMLTX2RefinerAttnProcessor),
        variants={"ltx-2": {**_LTX2, "gated_attn": False, "cross_attn_mod": False, "audio_gated_attn": False,
                            "audio_cross_attn_mod": False, "use_prompt_embeddings": True, "perturbed_attn": False}},
        sources="LTX-2's config (diffusers scripts/convert_ltx2_to_diffusers.py, version 2.0): the refiner is LTX-2 "
        "with another forward, 'a released LTX-2 checkpoint loads into it unchanged' (diffusers' class docstring; "
        "Efficient-Large-Model/SANA-WM_bidirectional ships it as refiner/refiner.safetensors, 41 GB)",
        default_variant="ltx-2",
        example_inputs=sana_wm_refiner_inputs,
        test_configs={"tiny": {**_LTX2_TINY, **_LTX2_WIDE, "num_layers": 1, "attention_bias": False},
                      "tiny_interleaved": {**_LTX2_TINY, "rope_type": "interleaved"}},
        # sink_rotary_emb: the KV cache's attention sink, re-rotated at its shifted offset; each rank caches its heads
        rotary={SanaWMLTX2Attention: ("query_rotary_emb", "key_rotary_emb", "sink_rotary_emb")},
    ),
)
