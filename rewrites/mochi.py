"""`MochiTransformer3DModel` (diffusers `transformer_mochi.py`): the `mochi` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`).
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import MochiAttention, MochiAttnProcessor2_0
from diffusers.models.transformers.transformer_mochi import MochiRoPE, MochiTransformer3DModel
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput

from surgery.extend import TensorParallel, Tests, derived_family
from surgery_rewrites.diffusers_common import cast_inputs


def mochi_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `MochiTransformer3DModel.forward`: a two-frame latent video of `image_tokens`
    patches, the text of `text_embed_dim` and its mask, one token more padded per sample (the processor attends over
    each sample's valid text tokens only)."""
    generator = torch.Generator().manual_seed(seed)
    frames = 2
    side = int((image_tokens // frames) ** 0.5) * config.get("patch_size", 2)
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    for i in range(batch):
        mask[i, text_tokens - 1 - i:] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 12), frames, side, side, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_embed_dim", 4096), generator=generator),
        timestep=(torch.rand(batch, generator=generator) * 1000).long(),
        encoder_attention_mask=mask,
    )
    return cast_inputs(inputs, dtype, device)


# Mochi learns its rotary frequencies per head (`pos_frequencies`: axes x heads x head_dim / 2, read by the model's
# `rope(pos_frequencies, frames, height, width)`): a rank rotates its own heads by its share of them, the slice of the
# heads dimension a Replicate -> Shard(1) redistribution takes locally (no collective in forward; the gradient is
# gathered back whole in backward).
MOCHI_ROPE_TP_PLAN = {"": PrepareModuleInput(input_layouts=(Replicate(), None, None, None),
                                             desired_input_layouts=(Shard(1), None, None, None), use_local_output=True)}


FAMILY = derived_family(
    "mochi", MochiTransformer3DModel, attention=(MochiAttention,), processors=(MochiAttnProcessor2_0,),
    variants={"1-preview": dict(patch_size=2, num_attention_heads=24, attention_head_dim=128, num_layers=48,
                                pooled_projection_dim=1536, in_channels=12, qk_norm="rms_norm",
                                text_embed_dim=4096, time_embed_dim=256, activation_fn="swiglu",
                                max_sequence_length=256)},
    sources="diffusers scripts/convert_mochi_to_diffusers.py (genmo/mochi-1-preview: MochiTransformer3DModel(), "
    "the class defaults: 48 layers, 24 heads of 128, text 4096, pooled 1536)",
    default_variant="1-preview",
    example_inputs=mochi_inputs,
    tp=TensorParallel(plans={MochiRoPE: MOCHI_ROPE_TP_PLAN}),
    tests=Tests(
        # feed-forward widths 8 x 48 // 3 = 128 and 8 x 24 // 3 = 64: worlds 2 and 4 split them
        configs={"tiny": dict(patch_size=2, num_attention_heads=4, attention_head_dim=12, num_layers=2,
                              pooled_projection_dim=24, in_channels=4, text_embed_dim=16, time_embed_dim=8)},
    ),
)
