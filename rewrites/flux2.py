"""FLUX.2 (diffusers `Flux2Transformer2DModel`): the fused leaves, their unfused forms and the slices between them.

Every stock class, forward and processor stays; only the fused Linears are swapped for leaves that compute the same
function behind the same call (`surgery.core.leaves`):

| module (diffusers class, kept)          | fused Linear        | unfused leaf                                      |
|-----------------------------------------|---------------------|---------------------------------------------------|
| `Flux2ParallelSelfAttention`            | `to_qkv_mlp_proj`   | `SplitRows`: rows -> `.q`, `.k`, `.v`, `.gate`,   |
|   (single-stream `attn`)                |                     |   `.up` (views)                                   |
|                                         | `to_out`            | `SplitProjection`: cols -> `.attn_part` (bias),   |
|                                         |                     |   `.mlp_part`                                     |
| `Flux2FeedForward` (`ff`, `ff_context`) | `linear_in`         | `SplitRows`: rows -> `.gate`, `.up` (views)       |
| `Flux2Attention` after                  | `to_qkv`            | `Flux2SplitQKVAttention`: to_q, to_k, to_v;       |
|   `fuse_qkv_projections()`              | `to_added_qkv`      |   add_q/k/v_proj                                  |

diffusers 0.42.1's single-stream processors (`Flux2ParallelSelfAttnProcessor`, the Klein KV one) already split the
projection by the global QKV:MLP ratio and heads by `head_dim`, and `Flux2SwiGLU` chunks its input in two: with the
leaves returning each rank's share of every part in order, the stock processors run whole or column-sharded.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_flux2 import (
    Flux2Attention,
    Flux2FeedForward,
    Flux2ParallelSelfAttention,
    Flux2Transformer2DModel,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery_rewrites.diffusers_common import DOUBLE_STREAM_ATTENTION_TP_PLAN, HEAD_NORM, SplitQKV, fused_qkv_rewrite
from surgery.core import build
from surgery.core.errors import SurgeryError
from surgery.extend import Family, TensorParallel, Tests, columns, rows, swap_rewrite
from surgery.parallel.styles import SPLIT_PROJECTION_TP_PLAN, under

# --- the leaves -----------------------------------------------------------------------------------------------------


def _qkv_mlp_parts(m: nn.Module) -> list[tuple[str, int]]:
    inner, mlp = m.inner_dim, m.mlp_hidden_dim
    return [("q", inner), ("k", inner), ("v", inner), ("gate", mlp), ("up", mlp)]


def _gate_up_parts(m: nn.Module) -> list[tuple[str, int]]:
    hidden = m.linear_out.in_features
    return [("gate", hidden), ("up", hidden)]


PARALLEL_SELF_ATTENTION = swap_rewrite(
    "flux2.parallel_self_attention",
    Flux2ParallelSelfAttention,
    leaves=(rows("to_qkv_mlp_proj", _qkv_mlp_parts), columns("to_out", lambda m: m.inner_dim)),
)
FEED_FORWARD = swap_rewrite("flux2.feed_forward", Flux2FeedForward, leaves=(rows("linear_in", _gate_up_parts),))

# gate and up split the hidden units across ranks; linear_out all-reduces once.
FEED_FORWARD_TP_PLAN = {
    "linear_in.gate": ColwiseParallel(),
    "linear_in.up": ColwiseParallel(),
    "linear_out": RowwiseParallel(),
}

# Heads and MLP hidden units split across ranks (QK-norms on each rank's own heads). Both parts of `to_out` leave
# partial sums, and its output resolves their sum with one all-reduce: one collective per single-stream block.
PARALLEL_SELF_ATTENTION_TP_PLAN = {
    "to_qkv_mlp_proj.q": ColwiseParallel(),
    "to_qkv_mlp_proj.k": ColwiseParallel(),
    "to_qkv_mlp_proj.v": ColwiseParallel(),
    "to_qkv_mlp_proj.gate": ColwiseParallel(),
    "to_qkv_mlp_proj.up": ColwiseParallel(),
    "norm_q": HEAD_NORM,
    "norm_k": HEAD_NORM,
    **under("to_out", SPLIT_PROJECTION_TP_PLAN),
}


class Flux2SplitQKVAttention(SplitQKV, Flux2Attention):
    """A `Flux2Attention` whose `fuse_qkv_projections()` fusion was split back (`SplitQKV`)."""


REWRITES = (
    PARALLEL_SELF_ATTENTION,
    FEED_FORWARD,
    fused_qkv_rewrite("flux2.fused_qkv_attention", Flux2Attention, Flux2SplitQKVAttention),
)

# The double-stream attention (stock, already unfused): the shared plan, one all-reduce per output projection.
TP_PLANS = {
    Flux2Attention: DOUBLE_STREAM_ATTENTION_TP_PLAN,
    Flux2SplitQKVAttention: DOUBLE_STREAM_ATTENTION_TP_PLAN,
    Flux2FeedForward: FEED_FORWARD_TP_PLAN,
    Flux2ParallelSelfAttention: PARALLEL_SELF_ATTENTION_TP_PLAN,
}


# --- the family: published configs, example inputs, test configs ----------------------------------------------------

# FLUX.2 transformer configs (diffusers' scripts/convert_flux2_to_diffusers.py and the published config.json files);
# the rest are Flux2Transformer2DModel defaults (in_channels=128, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
# timestep_guidance_channels=256).
VARIANTS = {
    "klein-4b": dict(
        num_layers=5, num_single_layers=20, num_attention_heads=24, attention_head_dim=128,
        joint_attention_dim=7680, guidance_embeds=False,
    ),
    "klein-9b": dict(
        num_layers=8, num_single_layers=24, num_attention_heads=32, attention_head_dim=128,
        joint_attention_dim=12288, guidance_embeds=False,
    ),
    "dev": dict(
        num_layers=8, num_single_layers=48, num_attention_heads=48, attention_head_dim=128,
        joint_attention_dim=15360, guidance_embeds=True,
    ),
}


def example_inputs(
    config: dict,
    batch: int = 1,
    image_tokens: int = 16,
    text_tokens: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict:
    """Seeded keyword arguments for `Flux2Transformer2DModel.forward` at `config` (a dict of its init arguments)."""
    generator = torch.Generator().manual_seed(seed)
    in_channels = config.get("in_channels", 128)
    axes = len(config.get("axes_dims_rope", (32, 32, 32, 32)))
    inputs = dict(
        hidden_states=torch.randn(batch, image_tokens, in_channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("joint_attention_dim", 15360), generator=generator),
        timestep=torch.rand(batch, generator=generator),
        img_ids=torch.randint(0, 64, (image_tokens, axes), generator=generator),
        txt_ids=torch.randint(0, 64, (text_tokens, axes), generator=generator),
        guidance=torch.full((batch,), 3.5) if config.get("guidance_embeds", True) else None,
    )
    floating = {"hidden_states", "encoder_hidden_states", "timestep", "guidance"}
    return {
        k: None if v is None else v.to(device=device, dtype=dtype if k in floating else v.dtype)
        for k, v in inputs.items()
    }


def reduced(config: dict, layers: int = 2, single_layers: int = 4, head_dim: int = 32) -> dict:
    """A published config at demo size: same head count, MLP ratio and text width; fewer blocks, smaller heads."""
    if head_dim % 8:
        raise SurgeryError(f"head_dim {head_dim} is not a multiple of 8 (4 rotary axes of even size)")
    config = dict(config, num_layers=layers, num_single_layers=single_layers, attention_head_dim=head_dim)
    config["axes_dims_rope"] = (head_dim // 4,) * 4
    return config


def _small(**config) -> dict:
    rope = {8: (2, 2, 2, 2), 12: (2, 2, 4, 4), 16: (4, 4, 4, 4)}[config["attention_head_dim"]]
    return dict(config, in_channels=16, timestep_guidance_channels=32, axes_dims_rope=rope)


# Small-width configs shaped like the real ones (depth and head-count ratios), plus awkward shapes. The first one is
# what the conformance suite shards (world 2 and 4), so its heads and hidden sizes divide by 4.
TEST_CONFIGS = {
    # 8 heads and int(64 * 2.5) = 160 hidden units split evenly over 2 and 4 ranks
    "tp_wide": _small(num_layers=2, num_single_layers=2, num_attention_heads=8, attention_head_dim=8,
                      joint_attention_dim=24, mlp_ratio=2.5, guidance_embeds=True),
    # klein-4B: 5 double / 20 single, 24 heads -> 1 / 4, 3 heads
    "klein4b_small": _small(num_layers=1, num_single_layers=4, num_attention_heads=3, attention_head_dim=16,
                            joint_attention_dim=32, guidance_embeds=False),
    # klein-9B: 8 / 24, 32 heads -> 1 / 3, 4 heads
    "klein9b_small": _small(num_layers=1, num_single_layers=3, num_attention_heads=4, attention_head_dim=16,
                            joint_attention_dim=48, guidance_embeds=False),
    # dev: 8 / 48, 48 heads, guidance -> 1 / 6, 6 heads
    "dev_small": _small(num_layers=1, num_single_layers=6, num_attention_heads=6, attention_head_dim=8,
                        joint_attention_dim=40, guidance_embeds=True),
    "odd_heads": _small(num_layers=2, num_single_layers=2, num_attention_heads=5, attention_head_dim=12,
                        joint_attention_dim=24, mlp_ratio=2.5, guidance_embeds=True),
    # int(56 * 3.3) = 184: fractional mlp_ratio
    "fractional_mlp": _small(num_layers=1, num_single_layers=2, num_attention_heads=7, attention_head_dim=8,
                             joint_attention_dim=16, mlp_ratio=3.3, guidance_embeds=False),
}

FAMILY = Family(
    name="flux2",
    model_class=Flux2Transformer2DModel,
    variants=VARIANTS,
    sources="diffusers scripts/convert_flux2_to_diffusers.py; black-forest-labs/FLUX.2-dev, FLUX.2-klein-4B/9B "
    "transformer/config.json",
    default_variant="klein-4b",
    example_inputs=example_inputs,
    rewrites=REWRITES,
    shrink_config=reduced,
    tp=TensorParallel(
        plans=TP_PLANS,
        # per double block: attention out + added out + ff + ff_context; per single block: one (partial sums
        # resolved once)
        all_reduces=lambda config: 4 * config["num_layers"] + config["num_single_layers"],
    ),
    tests=Tests(configs=TEST_CONFIGS),
)


def seeded_model(config: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> Flux2Transformer2DModel:
    """`Flux2Transformer2DModel(**config)` with every weight drawn from `seed` (see `surgery.testing.seeded_model`)."""
    return build.seeded_model(FAMILY, config, seed, dtype)
