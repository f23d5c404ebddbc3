"""Stable Audio 3 (diffusers `transformer_stable_audio3.py`): a DiT over audio latents with differential self- and
cross-attention (`Attn(Q1, K1, V) - Attn(Q2, K2, V)`) and a SwiGLU feed-forward, each holding fused projections.

Unfused the drop-in way: the stock classes and forwards stay; each fused Linear becomes a `SplitRows` whose parts
are views of its rows, in order:

| module (diffusers class, kept)      | fused Linear | rows (differential; plain)                         |
|-------------------------------------|--------------|----------------------------------------------------|
| `StableAudio3SelfAttention`         | `to_qkv`     | `.q1 .q2 .k1 .k2 .v`; `.q .k .v`                   |
| `StableAudio3CrossAttention`        | `to_q`       | `.q1 .q2`; `.q`                                    |
|                                     | `to_kv`      | `.k1 .k2 .v`; `.k .v`                              |
| `StableAudio3FeedForward`           | `proj_in`    | `.up .gate`                                        |

The processors `chunk` each fused output into its parts (each rank's share of every part, in order, from a
`SplitRows`) and unflatten by `(attn.heads, attn.dim_heads)`: their head-dim twins unflatten by `(-1,
attn.dim_heads)` (one listed edit each). 3 all-reduces per block (self-attention, cross-attention, feed-forward
outputs). The per-block inpainting projection `to_local_embed` reads the replicated local conditioning: whole.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_stable_audio3 import (
    StableAudio3CrossAttention,
    StableAudio3CrossAttnProcessor,
    StableAudio3DiTBlock,
    StableAudio3DiTModel,
    StableAudio3FeedForward,
    StableAudio3SelfAttention,
    StableAudio3SelfAttnProcessor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery_rewrites.diffusers_common import HEAD_NORM, cast_inputs, qkv_rows
from surgery.extend import Processors, TensorParallel, Tests, derived_family, register_edits, rows, swap_rewrite

for _processor in (StableAudio3SelfAttnProcessor, StableAudio3CrossAttnProcessor):
    register_edits(_processor, "__call__", (("(attn.heads, attn.dim_heads)", "(-1, attn.dim_heads)", 1),))


def _width(attn) -> int:
    return attn.heads * attn.dim_heads


def _parts(differential: tuple[str, ...], plain: tuple[str, ...]):
    return lambda attn: differential if attn.use_differential else plain


def _rows(name: str, differential: tuple[str, ...], plain: tuple[str, ...]):
    parts = _parts(differential, plain)
    return rows(name, lambda attn: [(part, _width(attn)) for part in parts(attn)])


REWRITES = (
    swap_rewrite("stable_audio3.self_attention", StableAudio3SelfAttention,
                 leaves=(_rows("to_qkv", ("q1", "q2", "k1", "k2", "v"), ("q", "k", "v")),),
                 processors=Processors((StableAudio3SelfAttnProcessor,))),
    swap_rewrite("stable_audio3.cross_attention", StableAudio3CrossAttention,
                 leaves=(_rows("to_q", ("q1", "q2"), ("q",)), _rows("to_kv", ("k1", "k2", "v"), ("k", "v"))),
                 processors=Processors((StableAudio3CrossAttnProcessor,))),
    swap_rewrite("stable_audio3.feed_forward", StableAudio3FeedForward,
                 leaves=(qkv_rows("proj_in", lambda ff: ff.proj_out.in_features, ("up", "gate")),)),
)

# Heads split across ranks (q/k norms per head); only the keys a module holds apply (differential or plain parts).
SELF_ATTENTION_TP_PLAN = {
    **{f"to_qkv.{part}": ColwiseParallel() for part in ("q1", "q2", "k1", "k2", "q", "k", "v")},
    "q_norm": HEAD_NORM,
    "k_norm": HEAD_NORM,
    "to_out": RowwiseParallel(),
}
CROSS_ATTENTION_TP_PLAN = {
    **{f"to_q.{part}": ColwiseParallel() for part in ("q1", "q2", "q")},
    **{f"to_kv.{part}": ColwiseParallel() for part in ("k1", "k2", "k", "v")},
    "q_norm": HEAD_NORM,
    "k_norm": HEAD_NORM,
    "to_out": RowwiseParallel(),
}
FEED_FORWARD_TP_PLAN = {"proj_in.up": ColwiseParallel(), "proj_in.gate": ColwiseParallel(),
                        "proj_out": RowwiseParallel()}


def stable_audio3_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                         dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `StableAudio3DiTModel.forward`, as diffusers' own model test builds them: a
    latent of `image_tokens` audio frames, a timestep in [0, 1], the text context with its mask (the last token
    padding, replaced by the learned padding embedding), the global duration embedding, and the inpainting
    conditioning (so each block's `to_local_embed` runs)."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, text_tokens, dtype=torch.bool)
    mask[:, -1] = False
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("io_channels", 256), image_tokens, generator=generator),
        timestep=torch.rand(batch, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("cond_token_dim", 768), generator=generator),
        global_hidden_states=torch.randn(batch, config.get("global_cond_dim", 768), generator=generator),
        encoder_attention_mask=mask,
        local_add_cond=torch.randn(batch, config.get("local_add_cond_dim", 257), image_tokens, generator=generator),
    )
    return cast_inputs(inputs, dtype, device)


# diffusers' tests/models/transformers/test_models_transformer_stable_audio3.py, TINY_CFG (plain attention)
_TESTER = dict(io_channels=8, patch_size=1, embed_dim=32, depth=2, num_heads=4, cond_token_dim=16, global_cond_dim=12,
               local_add_cond_dim=5, timestep_features_dim=16, ff_mult=2, num_memory_tokens=3,
               use_differential_attention=False)

FAMILY = derived_family(
    "stable-audio-3", StableAudio3DiTModel,
    rewrites=REWRITES,
    # diffusers' test PROD_CFG, "from stabilityai/stable-audio-3-medium model_config.json" (= the class defaults)
    variants={"medium": dict(io_channels=256, patch_size=1, embed_dim=1536, depth=24, num_heads=24,
                             cond_token_dim=768, global_cond_dim=768, local_add_cond_dim=257,
                             timestep_features_dim=256, ff_mult=4.0, num_memory_tokens=64,
                             use_differential_attention=True)},
    sources="diffusers tests/models/transformers/test_models_transformer_stable_audio3.py PROD_CFG (from "
    "stabilityai/stable-audio-3-medium model_config.json: 24 blocks, 24 heads of 64, differential attention, 64 "
    "memory tokens), equal to StableAudio3DiTModel's defaults",
    default_variant="medium",
    example_inputs=stable_audio3_inputs,
    tp=TensorParallel(
        plans={StableAudio3SelfAttention: SELF_ATTENTION_TP_PLAN, StableAudio3CrossAttention: CROSS_ATTENTION_TP_PLAN,
               StableAudio3FeedForward: FEED_FORWARD_TP_PLAN},
        replicated={StableAudio3DiTBlock: {
            "to_local_embed.*": "the inpainting conditioning's per-block projection (its input is replicated; its "
            "output is added to the whole-width residual)"}},
    ),
    tests=Tests(
        # the first (sharded at worlds 2 and 4): diffusers' TINY_CFG with the published differential attention; then
        # TINY_CFG as it is (plain attention)
        configs={"tiny_differential": dict(_TESTER, use_differential_attention=True), "tiny": dict(_TESTER)},
    ),
)
