"""Motif-Video (diffusers `MotifVideoTransformer3DModel`): the single-stream block's fused output projection, and
self- and cross-attention that split heads by head size so that they run column-sharded.

| module (diffusers class, kept)     | swapped                                                                    |
|------------------------------------|----------------------------------------------------------------------------|
| `MotifVideoSingleTransformerBlock` | `proj_out` -> `SplitProjection` (`.attn_part`, `.mlp_part`); the processors |
|                                    | of its `attn` and `cross_attn`                                             |
| `MotifVideoAttention`              | processor `MotifVideoAttnProcessor2_0` -> head-dim twin                    |
| `MotifVideoCrossAttention`         | processor `MotifVideoCrossAttnProcessor2_0` -> head-dim twin               |

diffusers' Motif processors reshape with the stored head count (`unflatten(2, (attn.heads, -1))`); their twins
(`surgery.core.leaves.head_dim_twin`) are the stock source with `unflatten(2, (-1, attn.head_dim))`.

A single block's optional text cross-attention (`enable_text_cross_attention_single`) reads the block's attention
output, which is column-sharded (each rank's heads) under tensor parallelism, and adds its output back to it. Its plan
keeps that layout: `to_q` and `to_out.0` are row-sharded with their partial sums reduce-scattered back onto the same
heads (`RowwiseParallel(output_layouts=Shard(-1))`), `to_k` / `to_v` column-sharded: two reduce-scatters more per such
block, and the block's single all-reduce after `proj_out` stays.
"""

from __future__ import annotations

import math

import torch
from diffusers.models.transformers.transformer_motif_video import (
    MotifVideoAttention,
    MotifVideoAttnProcessor2_0,
    MotifVideoCrossAttention,
    MotifVideoCrossAttnProcessor2_0,
    MotifVideoSingleTransformerBlock,
    MotifVideoTransformer3DModel,
)
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery_rewrites.diffusers_common import (
    ATTENTION_TP_PLAN,
    DOUBLE_STREAM_ATTENTION_TP_PLAN,
    HEAD_NORM,
    balanced_rope_axes,
    flux_like_rewrites,
)
from surgery.extend import Family, Processors, TensorParallel, Tests, swap_rewrite
from surgery.parallel.styles import SPLIT_PROJECTION_TP_PLAN, under

_CROSS = Processors((MotifVideoCrossAttnProcessor2_0,))
REWRITES = (
    *flux_like_rewrites("motif_video", MotifVideoSingleTransformerBlock, MotifVideoAttention,
                        Processors((MotifVideoAttnProcessor2_0,)), children={"cross_attn": _CROSS}),
    swap_rewrite("motif_video.cross_attention", MotifVideoCrossAttention, processors=_CROSS),
)


# --- tensor-parallel plans ------------------------------------------------------------------------------------------

# The single-stream block: FLUX.1's (rewrites/diffusers_common.py) with an optional cross-attention. Heads and MLP
# hidden units split across ranks; both halves of proj_out leave partial sums that one all-reduce resolves. The
# cross-attention reads and adds to the column-sharded attention output: its query and output projections
# reduce-scatter their partial sums back onto each rank's heads.
CROSS_ATTENTION_SINGLE_BLOCK_TP_PLAN = {
    "attn.to_q": ColwiseParallel(),
    "attn.to_k": ColwiseParallel(),
    "attn.to_v": ColwiseParallel(),
    "attn.norm_q": HEAD_NORM,
    "attn.norm_k": HEAD_NORM,
    "cross_attn.to_q": RowwiseParallel(output_layouts=Shard(-1)),
    "cross_attn.to_k": ColwiseParallel(),
    "cross_attn.to_v": ColwiseParallel(),
    "cross_attn.norm_q": HEAD_NORM,
    "cross_attn.norm_k": HEAD_NORM,
    "cross_attn.to_out.0": RowwiseParallel(output_layouts=Shard(-1)),
    "proj_mlp": ColwiseParallel(),
    **under("proj_out", SPLIT_PROJECTION_TP_PLAN),
}

# The double block's self-attention (the shared double-stream plan) and its text cross-attention (its query input is
# whole: the shared one-stream plan): heads split across ranks, one all-reduce per output projection.
TP_PLANS = {
    MotifVideoAttention: DOUBLE_STREAM_ATTENTION_TP_PLAN,
    MotifVideoCrossAttention: ATTENTION_TP_PLAN,
    MotifVideoSingleTransformerBlock: CROSS_ATTENTION_SINGLE_BLOCK_TP_PLAN,
}


# --- the family: published configs, example inputs, test configs ----------------------------------------------------

# The MotifVideoTransformer3DModel defaults (diffusers 0.42.1). Published Motif-Video checkpoints' depth, width and
# cross-attention switches are not verified here.
VARIANTS = {
    "base": dict(
        in_channels=33, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
        num_single_layers=40, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
        norm_type="layer_norm", text_embed_dim=4096, rope_theta=256.0, rope_axes_dim=(16, 56, 56),
    ),
}
_DEFAULTS = dict(in_channels=33, patch_size=2, patch_size_t=1, text_embed_dim=4096)


def example_inputs(
    config: dict,
    batch: int = 1,
    image_tokens: int = 16,
    text_tokens: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict:
    """Seeded keyword arguments for `MotifVideoTransformer3DModel.forward` at `config`: one latent frame of
    `image_tokens` patches; the last text token of the second sample is padding (masked)."""
    config = dict(_DEFAULTS, **config)
    generator = torch.Generator().manual_seed(seed)
    height = max(d for d in range(1, math.isqrt(image_tokens) + 1) if image_tokens % d == 0)
    p, p_t = config["patch_size"], config["patch_size_t"]
    mask = torch.ones(batch, text_tokens, dtype=torch.int64)
    if batch > 1 and text_tokens > 1:
        mask[1, -1] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, config["in_channels"], p_t, height * p, image_tokens // height * p,
                                  generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text_tokens, config["text_embed_dim"], generator=generator),
        encoder_attention_mask=mask,
    )
    floating = {"hidden_states", "timestep", "encoder_hidden_states"}
    return {k: v.to(device=device, dtype=dtype if k in floating else v.dtype) for k, v in inputs.items()}


def reduced(config: dict, layers: int = 2, single_layers: int = 4, head_dim: int = 32) -> dict:
    """A published config at demo size: same head count and MLP ratio; fewer blocks, smaller heads, narrow text."""
    return dict(config, num_layers=layers, num_single_layers=single_layers, attention_head_dim=head_dim,
                rope_axes_dim=balanced_rope_axes(head_dim), text_embed_dim=64)


def _small(**config) -> dict:
    return dict(dict(in_channels=8, out_channels=4, text_embed_dim=24), **config)


# The first config is what the conformance suite shards (world 2 and 4): heads and MLP width divide by 4. Single-block
# cross-attention is sharded in tests/families/test_motif_video.py instead: the suite counts all-reduces only, and the
# fp32 gradients of that cross-attention's key bias (small, behind a QK-norm) sit near the suite's 1e-5 bound.
TEST_CONFIGS = {
    "tp_wide": _small(num_layers=1, num_single_layers=2, num_attention_heads=4, attention_head_dim=8,
                      rope_axes_dim=(2, 2, 4), enable_text_cross_attention_dual=True),
    # 24 heads -> 3; one decoder block (a single block that reads the encoder's output as its text states)
    "decoder_odd_heads": _small(num_layers=1, num_single_layers=3, num_decoder_layers=1, num_attention_heads=3,
                                attention_head_dim=12, rope_axes_dim=(4, 4, 4)),
}


def _all_reduces(config: dict) -> int:
    # per double block: attention out + added out + ff + ff_context (+ cross-attention out); per single block: one
    cross = 1 if config.get("enable_text_cross_attention_dual") else 0
    return (4 + cross) * config["num_layers"] + config["num_single_layers"]


FAMILY = Family(
    name="motif-video",
    model_class=MotifVideoTransformer3DModel,
    variants=VARIANTS,
    sources="MotifVideoTransformer3DModel defaults (diffusers 0.42.1); published checkpoints not verified",
    default_variant="base",
    example_inputs=example_inputs,
    rewrites=REWRITES,
    shrink_config=reduced,
    tp=TensorParallel(plans=TP_PLANS, all_reduces=_all_reduces),
    tests=Tests(configs=TEST_CONFIGS),
)
