"""`SanaWMLTX2RefinerTransformer3DModel` (diffusers `transformer_sana_wm_refiner.py`): the `sana-wm-refiner` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). Its processors rotate
q and k across the whole attention width before splitting heads, so the family row names the attention's rotary
arguments (`TensorParallel(rotary=...)`): rewrites/ltx2.py says how the derived plan shares the tables.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from diffusers.models.transformers.transformer_sana_wm_refiner import (
    SanaWMLTX2Attention,
    SanaWMLTX2AudioVideoAttnProcessor,
    SanaWMLTX2AudioVideoRotaryPosEmbed,
    SanaWMLTX2PerturbedAttnProcessor,
    SanaWMLTX2RefinerAttnProcessor,
    SanaWMLTX2RefinerTransformer3DModel,
)

from surgery.extend import TensorParallel, Tests, derived_family
from surgery_rewrites.diffusers_common import LTX2, LTX2_TINY, LTX2_WIDE, text_with_mask, video_grid


def sana_wm_refiner_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                           dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `SanaWMLTX2RefinerTransformer3DModel.forward` (its video stream only): the video
    tokens of one block, text for its caption projection, and the RoPE tables the caller supplies, built as the model's
    own `rope` builds them (`build_rotary_emb_for_absolute_positions` of frames 0..)."""
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = video_grid(image_tokens)
    text, mask = text_with_mask(generator, batch, text_tokens, config.get("caption_channels", 3840))
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


FAMILY = derived_family(
    "sana-wm-refiner", SanaWMLTX2RefinerTransformer3DModel, attention=(SanaWMLTX2Attention,),
    # the refiner sets its own self-attention processor (sliding-window KV cache), not among the class's listed
    processors=(SanaWMLTX2AudioVideoAttnProcessor, SanaWMLTX2PerturbedAttnProcessor,
                SanaWMLTX2RefinerAttnProcessor),
    variants={"ltx-2": {**LTX2, "gated_attn": False, "cross_attn_mod": False, "audio_gated_attn": False,
                        "audio_cross_attn_mod": False, "use_prompt_embeddings": True, "perturbed_attn": False}},
    sources="LTX-2's config (diffusers scripts/convert_ltx2_to_diffusers.py, version 2.0): the refiner is LTX-2 "
    "with another forward, 'a released LTX-2 checkpoint loads into it unchanged' (diffusers' class docstring; "
    "Efficient-Large-Model/SANA-WM_bidirectional ships it as refiner/refiner.safetensors, 41 GB)",
    default_variant="ltx-2",
    example_inputs=sana_wm_refiner_inputs,
    tp=TensorParallel(
        # sink_rotary_emb: the KV cache's attention sink, re-rotated at its shifted offset; each rank caches its heads
        rotary={SanaWMLTX2Attention: ("query_rotary_emb", "key_rotary_emb", "sink_rotary_emb")},
    ),
    tests=Tests(configs={"tiny": {**LTX2_TINY, **LTX2_WIDE, "num_layers": 1, "attention_bias": False},
                         "tiny_interleaved": {**LTX2_TINY, "rope_type": "interleaved"}}),
)
