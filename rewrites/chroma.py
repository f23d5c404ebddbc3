"""Chroma (diffusers `ChromaTransformer2DModel`: Chroma1-HD, Chroma1-Base): FLUX.1's architecture with pruned,
parameter-free AdaLN norms fed by one `distilled_guidance_layer` (an MLP approximator) instead of per-block
modulation Linears.

| module (diffusers class, kept)  | fused Linear                                  | unfused                        |
|---------------------------------|-----------------------------------------------|--------------------------------|
| `ChromaSingleTransformerBlock`  | `proj_out` (reads `cat([attn, mlp], dim=2)`)  | `SplitProjection`: cols ->     |
|                                 |                                               | `.attn_part` (bias), `.mlp_part` |

Its attention is FLUX.1's `FluxAttention` with the stock `FluxAttnProcessor` (heads split by `head_dim`), its
feed-forwards diffusers' `FeedForward`: their plans, and the `fuse_qkv_projections()` rewrite, are FLUX.1's
(`rewrites/flux.py`) and diffusers_common's, registered there once. The single block's plan is FLUX.1's too
(`SINGLE_BLOCK_TP_PLAN`, shared in rewrites/diffusers_common.py): same submodule names. The
`distilled_guidance_layer` (5 residual MLPs of width 5120, 0.28 B parameters, 3% of the model) stays replicated:
its layers are diffusers' shared `PixArtAlphaTextProjection`, which FLUX.1 also uses (as its pooled-text embedder),
so a class plan for it would shard FLUX.1's too; and it runs once per forward on 344 tokens.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_chroma import ChromaSingleTransformerBlock, ChromaTransformer2DModel

from surgery_rewrites.diffusers_common import SINGLE_BLOCK_TP_PLAN
from surgery_rewrites.flux import check_single_block, flux1_single_block_rewrite, rope_axes_like_flux1
from surgery.extend import Family, TensorParallel, Tests

REWRITES = (flux1_single_block_rewrite("chroma.single_block", ChromaSingleTransformerBlock),)

# The same submodule names as FLUX.1's single block: the same plan (one all-reduce per block).
TP_PLANS = {ChromaSingleTransformerBlock: SINGLE_BLOCK_TP_PLAN}
TP_CHECKS = {ChromaSingleTransformerBlock: check_single_block}


# lodestones/Chroma1-HD and Chroma1-Base transformer/config.json (the `ChromaTransformer2DModel` defaults; diffusers'
# single-file loader reads Chroma checkpoints with Chroma1-HD's config): FLUX.1-schnell's trunk — 19 double / 38
# single blocks, 24 heads x 128, T5 width 4096, rope axes (16, 56, 56) — and an approximator of 5 layers x 5120 on
# 64 input channels.
_CHROMA1 = dict(
    num_layers=19, num_single_layers=38, num_attention_heads=24, attention_head_dim=128, joint_attention_dim=4096,
    in_channels=64, axes_dims_rope=(16, 56, 56), approximator_num_channels=64, approximator_hidden_dim=5120,
    approximator_layers=5,
)
VARIANTS = {"hd": dict(_CHROMA1), "base": dict(_CHROMA1)}


def example_inputs(
    config: dict,
    batch: int = 1,
    image_tokens: int = 16,
    text_tokens: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict:
    """Seeded keyword arguments for `ChromaTransformer2DModel.forward` at `config`, with an attention mask over text +
    image tokens that masks text padding. It is boolean: `ChromaPipeline` passes the same mask as 0/1 floats, which
    scaled_dot_product_attention adds to the scores (padding down-weighted by e, not masked) and differentiates."""
    generator = torch.Generator().manual_seed(seed)
    axes = len(config.get("axes_dims_rope", (16, 56, 56)))
    lengths = torch.full((batch,), text_tokens)
    lengths[0::2] -= text_tokens // 4  # every other prompt padded by a quarter
    text_mask = torch.arange(text_tokens)[None, :] < lengths[:, None]
    inputs = dict(
        hidden_states=torch.randn(batch, image_tokens, config.get("in_channels", 64), generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("joint_attention_dim", 4096),
                                          generator=generator),
        timestep=torch.rand(batch, generator=generator),
        # integer positions (FluxPosEmbed takes ids.float()): no gradient flows into them
        img_ids=torch.randint(0, 64, (image_tokens, axes), generator=generator),
        txt_ids=torch.zeros(text_tokens, axes, dtype=torch.long),
        attention_mask=torch.cat([text_mask, torch.ones(batch, image_tokens, dtype=torch.bool)], dim=1),
    )
    floating = {"hidden_states", "encoder_hidden_states", "timestep"}
    return {k: v.to(device=device, dtype=dtype if k in floating else v.dtype) for k, v in inputs.items()}


def reduced(config: dict, layers: int = 2, single_layers: int = 4, head_dim: int = 32) -> dict:
    """A published config at demo size: same head count; fewer blocks, smaller heads, a narrower approximator."""
    return dict(config, num_layers=layers, num_single_layers=single_layers, attention_head_dim=head_dim,
                axes_dims_rope=rope_axes_like_flux1(head_dim), approximator_hidden_dim=4 * head_dim,
                approximator_layers=2)


def small(**config) -> dict:
    return dict(config, in_channels=16, axes_dims_rope=rope_axes_like_flux1(config["attention_head_dim"]),
                approximator_num_channels=16, approximator_hidden_dim=32, approximator_layers=2)


# The first one is sharded at world 2 and 4: 4 heads x 8, 128 MLP units.
TEST_CONFIGS = {
    "tp_hd": small(num_layers=1, num_single_layers=2, num_attention_heads=4, attention_head_dim=8,
                   joint_attention_dim=24),
    "odd_heads": small(num_layers=1, num_single_layers=2, num_attention_heads=3, attention_head_dim=12,
                       joint_attention_dim=16),
}

FAMILY = Family(
    name="chroma",
    model_class=ChromaTransformer2DModel,
    variants=VARIANTS,
    sources="lodestones/Chroma1-HD and lodestones/Chroma1-Base transformer/config.json (= ChromaTransformer2DModel's "
    "defaults); diffusers loaders/single_file_utils.py maps Chroma checkpoints to Chroma1-HD's config",
    default_variant="hd",
    example_inputs=example_inputs,
    rewrites=REWRITES,
    shrink_config=reduced,
    tp=TensorParallel(
        plans=TP_PLANS,
        checks=TP_CHECKS,
        # per double block: to_out + to_add_out + ff + ff_context; per single block: one. (diffusers has no Chroma
        # plan.)
        all_reduces=lambda config: 4 * config.get("num_layers", 19) + config.get("num_single_layers", 38),
    ),
    tests=Tests(configs=TEST_CONFIGS),
)
