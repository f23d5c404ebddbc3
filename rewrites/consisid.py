"""`ConsisIDTransformer3DModel` (diffusers `consisid_transformer_3d.py`): the `consisid` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). The adaptive norms'
Linears stay whole by the general rule of `surgery.parallel.plans.replicated_reason`.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.consisid_transformer_3d import (
    ConsisIDTransformer3DModel,
    LocalFacialExtractor,
    PerceiverCrossAttention,
)

from surgery.extend import TensorParallel, Tests, derived_family
from surgery_rewrites.diffusers_common import GENERIC, cogvideox_inputs


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


FAMILY = derived_family(
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
    tp=TensorParallel(replicated={PerceiverCrossAttention: {"to_*": FACE}, LocalFacialExtractor: {"*": FACE}}),
    tests=Tests(
        # the face cross attention reads LFE_output_dim = 2/3 of the model width: heads of 12. 16 face queries: with 2,
        # its q gradient is a difference of near-equal terms, 4e-5 apart between two fp32 summation orders
        configs={"tiny": dict(num_attention_heads=4, attention_head_dim=12, in_channels=4, out_channels=4,
                              time_embed_dim=16, text_embed_dim=16, num_layers=2, sample_width=4,
                              sample_height=4, sample_frames=5, max_text_seq_length=8, is_train_face=True,
                              is_kps=False, cross_attn_interval=1, cross_attn_dim_head=8, cross_attn_num_heads=2,
                              LFE_id_dim=8, LFE_vit_dim=8, LFE_depth=2, LFE_dim_head=8, LFE_num_heads=2,
                              LFE_num_id_token=2, LFE_num_querie=16, LFE_output_dim=32, LFE_ff_mult=1,
                              LFE_num_scale=2)},
    ),
)
