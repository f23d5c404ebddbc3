"""More DiTs derived from diffusers' building blocks (`surgery.extend.derived_family`): one row per model class,
data only (published configs with their source, tiny test configs, example inputs). Plans, rewrites and all-reduce
counts are derived (`surgery.parallel.derive`).

Lumina2's processor attends with grouped queries (`kv_heads` read off the key width); the processor rule of
`surgery.core.leaves` reads its head counts from the local widths, and the derived head check splits query and
key/value heads alike, so a rank holds whole groups.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention, MochiAttention, MochiAttnProcessor2_0
from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Attention, Kandinsky5Transformer3DModel
from diffusers.models.transformers.transformer_lumina2 import Lumina2Transformer2DModel
from diffusers.models.transformers.transformer_mochi import MochiRoPE, MochiTransformer3DModel
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput

from surgery.extend import derived_family


def _cast(inputs: dict, dtype: torch.dtype, device) -> dict:
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


def lumina2_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `Lumina2Transformer2DModel.forward`: a square latent of `image_tokens` patches,
    the caption features of `cap_feat_dim` and their mask, padded by one token more per sample (captions of unequal
    length: the joint blocks' mask path)."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    mask = torch.ones(batch, text_tokens, dtype=torch.bool)
    for i in range(batch):
        mask[i, text_tokens - 1 - i:] = False
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), side, side, generator=generator),
        timestep=torch.rand(batch, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("cap_feat_dim", 1024), generator=generator),
        encoder_attention_mask=mask,
    )
    return _cast(inputs, dtype, device)


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
    return _cast(inputs, dtype, device)


def kandinsky5_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                      dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `Kandinsky5Transformer3DModel.forward`: a channels-last latent video of
    `image_tokens` patches (two frames; with `visual_cond`, the conditioning frames and their mask beside the noise,
    as the pipeline concatenates them), the Qwen text and the pooled CLIP embedding, and the rotary positions the
    pipeline builds (an arange per latent axis in patches, one over the text)."""
    generator = torch.Generator().manual_seed(seed)
    frames, (_, p_h, p_w) = 2, config.get("patch_size", (1, 2, 2))
    side = int((image_tokens // frames) ** 0.5)
    channels = config.get("in_visual_dim", 4)
    channels = 2 * channels + 1 if config.get("visual_cond", False) else channels
    inputs = dict(
        hidden_states=torch.randn(batch, frames, side * p_h, side * p_w, channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("in_text_dim", 3584), generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        pooled_projections=torch.randn(batch, config.get("in_text_dim2", 768), generator=generator),
    )
    positions = dict(visual_rope_pos=[torch.arange(n, device=device) for n in (frames, side, side)],
                     text_rope_pos=torch.arange(text_tokens, device=device))
    return {**_cast(inputs, dtype, device), **positions}


# Mochi learns its rotary frequencies per head (`pos_frequencies`: axes x heads x head_dim / 2, read by the model's
# `rope(pos_frequencies, frames, height, width)`): a rank rotates its own heads by its share of them, the slice of the
# heads dimension a Replicate -> Shard(1) redistribution takes locally (no collective in forward; the gradient is
# gathered back whole in backward).
MOCHI_ROPE_TP_PLAN = {"": PrepareModuleInput(input_layouts=(Replicate(), None, None, None),
                                             desired_input_layouts=(Shard(1), None, None, None), use_local_output=True)}

FAMILIES = (
    derived_family(
        "lumina2", Lumina2Transformer2DModel, attention=(Attention,),
        variants={
            "image-2.0": dict(sample_size=128, patch_size=2, in_channels=16, hidden_size=2304, num_layers=26,
                              num_refiner_layers=2, num_attention_heads=24, num_kv_heads=8, multiple_of=256,
                              ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(32, 32, 32),
                              axes_lens=(300, 512, 512), cap_feat_dim=2304),
        },
        sources="transformer/config.json of Alpha-VLLM/Lumina-Image-2.0 (diffusers' Lumina2Transformer2DModel "
        "defaults but cap_feat_dim 2304, its Gemma-2-2B text encoder's width; the original NextDiT 2B GQA: 26 "
        "layers, 24 heads of 96, 8 key/value heads)",
        default_variant="image-2.0",
        example_inputs=lumina2_inputs,
        # 8 query heads in 4 groups of 2: worlds 2 and 4 split both counts
        test_configs={"tiny": dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=64, num_layers=2,
                                   num_refiner_layers=1, num_attention_heads=8, num_kv_heads=4, multiple_of=8,
                                   axes_dim_rope=(4, 2, 2), axes_lens=(128, 128, 128), cap_feat_dim=16)},
    ),
    derived_family(
        "mochi", MochiTransformer3DModel, attention=(MochiAttention,), processors=(MochiAttnProcessor2_0,),
        variants={"1-preview": dict(patch_size=2, num_attention_heads=24, attention_head_dim=128, num_layers=48,
                                    pooled_projection_dim=1536, in_channels=12, qk_norm="rms_norm",
                                    text_embed_dim=4096, time_embed_dim=256, activation_fn="swiglu",
                                    max_sequence_length=256)},
        sources="diffusers scripts/convert_mochi_to_diffusers.py (genmo/mochi-1-preview: MochiTransformer3DModel(), "
        "the class defaults: 48 layers, 24 heads of 128, text 4096, pooled 1536)",
        default_variant="1-preview",
        example_inputs=mochi_inputs,
        tp_plans={MochiRoPE: MOCHI_ROPE_TP_PLAN},
        # feed-forward widths 8 x 48 // 3 = 128 and 8 x 24 // 3 = 64: worlds 2 and 4 split them
        test_configs={"tiny": dict(patch_size=2, num_attention_heads=4, attention_head_dim=12, num_layers=2,
                                   pooled_projection_dim=24, in_channels=4, text_embed_dim=16, time_embed_dim=8)},
    ),
    derived_family(
        "kandinsky5", Kandinsky5Transformer3DModel, attention=(Kandinsky5Attention,),
        variants={"t2v-lite": dict(in_visual_dim=16, out_visual_dim=16, time_dim=512, patch_size=(1, 2, 2),
                                   model_dim=1792, ff_dim=7168, num_text_blocks=2, num_visual_blocks=32,
                                   axes_dims=(16, 24, 24), in_text_dim=3584, in_text_dim2=768, visual_cond=True)},
        sources="transformer/config.json of kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers (the Kandinsky 5.0 "
        "T2V Lite DiT of ai-forever/Kandinsky-5: 2 text and 32 visual blocks, width 1792 = 28 heads of 64 "
        "(axes 16 + 24 + 24), feed-forward 7168, Qwen2.5-VL text 3584, CLIP-L pooled 768)",
        default_variant="t2v-lite",
        example_inputs=kandinsky5_inputs,
        # its rotary casts q and k to bfloat16 (`apply_rotary`'s `.to(torch.bfloat16)`), also in a float32 model
        rounds_to=torch.bfloat16,
        test_configs={"tiny": dict(in_visual_dim=4, out_visual_dim=4, time_dim=16, patch_size=(1, 2, 2), model_dim=32,
                                   ff_dim=64, num_text_blocks=1, num_visual_blocks=2, axes_dims=(2, 2, 4),
                                   in_text_dim=16, in_text_dim2=8, visual_cond=True)},
    ),
)
