"""`LTX2VideoTransformer3DModel` (diffusers `transformer_ltx2.py`): the `ltx-2` family.

A derived family (`surgery.extend.derived_family`): published configs with their source, tiny test configs, example
inputs.

Its processors rotate q and k across the whole attention width before splitting heads, so the family names the
attention's rotary arguments (`TensorParallel(rotary=...)`): the derived plan hands each rank its heads' share of the
tables (`surgery.parallel.derive.RotaryAcrossWidth`; LTX-2's "split" tables `[batch, heads, tokens, head_dim / 2]` by
their heads, the "interleaved" ones `[batch, tokens, width]` by their width). The rest is derived: head-dim twins of the
processors, q/k norms across heads by their statistic, LTX-2's per-head gates (`to_gate_logits`) colwise with the
heads, the feed-forwards' shared plan.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_ltx2 import LTX2Attention, LTX2VideoTransformer3DModel

from surgery.extend import TensorParallel, Tests, derived_family
from surgery_rewrites.diffusers_common import LTX2, LTX2_TINY, LTX2_WIDE, text_with_mask, video_grid


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
    text, mask = text_with_mask(generator, batch, text_tokens, video_text)
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


_LTX2_3 = dict(gated_attn=True, cross_attn_mod=True, audio_gated_attn=True, audio_cross_attn_mod=True,
               use_prompt_embeddings=False, perturbed_attn=True)


_LTX2_TP = {**LTX2_TINY, **_LTX2_3, **LTX2_WIDE, "num_layers": 1, "attention_bias": False}


FAMILY = derived_family(
    "ltx-2", LTX2VideoTransformer3DModel, attention=(LTX2Attention,),
    variants={
        "2.0": {**LTX2, "gated_attn": False, "cross_attn_mod": False, "audio_gated_attn": False,
                "audio_cross_attn_mod": False, "use_prompt_embeddings": True, "perturbed_attn": False},
        "2.3": {**LTX2, **_LTX2_3},
        "2.5": {**LTX2, **_LTX2_3, "ff_bias": False, "use_keyframes_abs_pos_embedding": True},
    },
    sources="diffusers scripts/convert_ltx2_to_diffusers.py (get_ltx2_transformer_config: Lightricks/LTX-2, "
    "Lightricks/LTX-2.3, Lightricks/LTX-2.5)",
    default_variant="2.3",
    example_inputs=ltx2_inputs,
    tp=TensorParallel(rotary={LTX2Attention: ("query_rotary_emb", "key_rotary_emb")}),
    tests=Tests(
        # the first runs sharded in the conformance suite: LTX-2.3's gated, perturbed attention with split RoPE
        # tables; the two-block ones (with attention biases, both RoPE layouts) in tests/families/test_ltx.py
        configs={"tiny": _LTX2_TP, "tiny_2.3": {**LTX2_TINY, **_LTX2_3},
                 "tiny_2.0_interleaved": {**LTX2_TINY, "rope_type": "interleaved"}},
    ),
)
