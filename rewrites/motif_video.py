"""Motif-Video (diffusers `MotifVideoTransformer3DModel`): the single-stream block's fused output projection, and
self- and cross-attention that split heads by head size so that they run column-sharded.

| stock (diffusers)                  | rewritten (here)                          | slices                       |
|------------------------------------|-------------------------------------------|------------------------------|
| `MotifVideoSingleTransformerBlock` | `MotifVideoUnfusedSingleTransformerBlock` | proj_out cols -> .attn, .mlp |
| `MotifVideoAttention`              | `MotifVideoSplitHeadsAttention`           | none                         |
| `MotifVideoCrossAttention`         | `MotifVideoSplitHeadsCrossAttention`      | none                         |

diffusers' Motif processors reshape with the stored head count (`unflatten(2, (attn.heads, -1))`); their twins here
are the same code with `unflatten(2, (-1, attn.head_dim))`.

A single block's optional text cross-attention (`enable_text_cross_attention_single`) reads the block's attention
output, which is column-sharded (each rank's heads) under tensor parallelism, and adds its output back to it. Its plan
keeps that layout: `to_q` and `to_out.0` are row-sharded with their partial sums reduce-scattered back onto the same
heads (`RowwiseParallel(output_layouts=Shard(-1))`), `to_k` / `to_v` column-sharded: two reduce-scatters more per such
block, and the block's single all-reduce after `proj_out` stays.
"""

from __future__ import annotations

import math

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_motif_video import (
    MotifVideoAttention,
    MotifVideoAttnProcessor2_0,
    MotifVideoCrossAttention,
    MotifVideoCrossAttnProcessor2_0,
    MotifVideoSingleTransformerBlock,
    MotifVideoTransformer3DModel,
)
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel

from rewrites.longcat_image import attention_rewrite, rope_axes, single_block_rewrite
from surgery.registry import Family
from surgery.tensor_parallel import per_head_norm


class MotifVideoSplitHeadsAttnProcessor(MotifVideoAttnProcessor2_0):
    """`MotifVideoAttnProcessor2_0` (diffusers 0.42.1) verbatim, heads split by `attn.head_dim` instead of counted."""

    def __call__(
        self,
        attn: MotifVideoAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn.add_q_proj is None and encoder_hidden_states is not None:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

        query = attn.to_q(hidden_states).unflatten(2, (-1, attn.head_dim))
        key = attn.to_k(hidden_states).unflatten(2, (-1, attn.head_dim))
        value = attn.to_v(hidden_states).unflatten(2, (-1, attn.head_dim))

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        if image_rotary_emb is not None:
            if attn.add_q_proj is None and encoder_hidden_states is not None:
                split_idx = -encoder_hidden_states.shape[1]
                query = torch.cat(
                    [apply_rotary_emb(query[:, :split_idx], image_rotary_emb, sequence_dim=1), query[:, split_idx:]],
                    dim=1,
                )
                key = torch.cat(
                    [apply_rotary_emb(key[:, :split_idx], image_rotary_emb, sequence_dim=1), key[:, split_idx:]],
                    dim=1,
                )
            else:
                query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
                key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            encoder_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (-1, attn.head_dim))
            encoder_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (-1, attn.head_dim))
            encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (-1, attn.head_dim))

            if attn.norm_added_q is not None:
                encoder_query = attn.norm_added_q(encoder_query)
            if attn.norm_added_k is not None:
                encoder_key = attn.norm_added_k(encoder_key)

            query = torch.cat([query, encoder_query], dim=1)
            key = torch.cat([key, encoder_key], dim=1)
            value = torch.cat([value, encoder_value], dim=1)

        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (
                hidden_states[:, : -encoder_hidden_states.shape[1]],
                hidden_states[:, -encoder_hidden_states.shape[1] :],
            )

            if attn.to_out is not None:
                hidden_states = attn.to_out[0](hidden_states)
                hidden_states = attn.to_out[1](hidden_states)

            if attn.to_add_out is not None:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

            return hidden_states, encoder_hidden_states

        if attn.to_out is not None:
            hidden_states = attn.to_out[0](hidden_states)
            hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


class MotifVideoSplitHeadsCrossAttnProcessor(MotifVideoCrossAttnProcessor2_0):
    """`MotifVideoCrossAttnProcessor2_0` (diffusers 0.42.1) verbatim, heads split by `attn.head_dim`."""

    def __call__(
        self,
        attn: MotifVideoCrossAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
        image_embed_seq_len: int = 0,
    ) -> torch.Tensor:
        txt_kv = encoder_hidden_states[:, image_embed_seq_len:, :]
        text_mask = None
        if attention_mask is not None:
            text_mask = attention_mask[:, :, :, image_embed_seq_len - encoder_hidden_states.shape[1] :]

        query = attn.to_q(hidden_states).unflatten(2, (-1, attn.head_dim))
        key = attn.to_k(txt_kv).unflatten(2, (-1, attn.head_dim))
        value = attn.to_v(txt_kv).unflatten(2, (-1, attn.head_dim))

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)

        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=text_mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


class MotifVideoSplitHeadsAttention(MotifVideoAttention):
    """A `MotifVideoAttention` running `MotifVideoSplitHeadsAttnProcessor`."""

    _default_processor_cls = MotifVideoSplitHeadsAttnProcessor
    _available_processors = [MotifVideoSplitHeadsAttnProcessor]


class MotifVideoSplitHeadsCrossAttention(MotifVideoCrossAttention):
    """A `MotifVideoCrossAttention` running `MotifVideoSplitHeadsCrossAttnProcessor`."""

    _default_processor_cls = MotifVideoSplitHeadsCrossAttnProcessor
    _available_processors = [MotifVideoSplitHeadsCrossAttnProcessor]


class MotifVideoUnfusedSingleTransformerBlock(MotifVideoSingleTransformerBlock):
    """`MotifVideoSingleTransformerBlock` whose `proj_out` is a `SplitProjection`: `proj_out(attn, mlp)` instead of
    `proj_out(cat([attn, mlp], dim=2))`. The forward is diffusers 0.42.1's otherwise."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        image_embed_seq_len: int = 0,
    ) -> torch.Tensor:
        encoder_seq_length = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

        residual = hidden_states
        norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
        mlp_hidden_states = self.act_mlp(self.proj_mlp(norm_hidden_states))

        norm_hidden_states, norm_encoder_hidden_states = (
            norm_hidden_states[:, :-encoder_seq_length, :],
            norm_hidden_states[:, -encoder_seq_length:, :],
        )

        attn_output, context_attn_output = self.attn(
            hidden_states=norm_hidden_states,
            encoder_hidden_states=norm_encoder_hidden_states,
            attention_mask=attention_mask,
            image_rotary_emb=image_rotary_emb,
        )

        if self.cross_attn is not None:
            cross_output = self.cross_attn(
                hidden_states=attn_output,
                encoder_hidden_states=norm_encoder_hidden_states,
                attention_mask=attention_mask,
                image_rotary_emb=image_rotary_emb,
                image_embed_seq_len=image_embed_seq_len,
            )
            attn_output = attn_output + cross_output

        attn_output = torch.cat([attn_output, context_attn_output], dim=1)
        hidden_states = gate.unsqueeze(1) * self.proj_out(attn_output, mlp_hidden_states)
        hidden_states = hidden_states + residual

        hidden_states, encoder_hidden_states = (
            hidden_states[:, :-encoder_seq_length, :],
            hidden_states[:, -encoder_seq_length:, :],
        )
        return hidden_states, encoder_hidden_states


_ATTENTION = attention_rewrite(
    "motif_video.attention", MotifVideoAttention, MotifVideoSplitHeadsAttention, MotifVideoAttnProcessor2_0,
    twin_processor=MotifVideoSplitHeadsAttnProcessor,
)
_CROSS_ATTENTION = attention_rewrite(
    "motif_video.cross_attention", MotifVideoCrossAttention, MotifVideoSplitHeadsCrossAttention,
    MotifVideoCrossAttnProcessor2_0, twin_processor=MotifVideoSplitHeadsCrossAttnProcessor,
)
REWRITES = (
    single_block_rewrite(
        "motif_video.single_block", MotifVideoSingleTransformerBlock, MotifVideoUnfusedSingleTransformerBlock,
        _ATTENTION, nested={"cross_attn": _CROSS_ATTENTION},
    ),
    _ATTENTION,
    _CROSS_ATTENTION,
)


# --- tensor-parallel plans ------------------------------------------------------------------------------------------

# QK-norms act on each rank's own heads ([batch, seq, heads, head_dim]).
HEAD_NORM = per_head_norm(2)

# The double block's self-attention: heads split across ranks, one all-reduce per output projection.
ATTENTION_TP_PLAN = {
    "to_q": ColwiseParallel(),
    "to_k": ColwiseParallel(),
    "to_v": ColwiseParallel(),
    "norm_q": HEAD_NORM,
    "norm_k": HEAD_NORM,
    "to_out.0": RowwiseParallel(),
    "add_q_proj": ColwiseParallel(),
    "add_k_proj": ColwiseParallel(),
    "add_v_proj": ColwiseParallel(),
    "norm_added_q": HEAD_NORM,
    "norm_added_k": HEAD_NORM,
    "to_add_out": RowwiseParallel(),
}

# The double block's text cross-attention (its query input is whole): heads split across ranks, one all-reduce.
CROSS_ATTENTION_TP_PLAN = {
    "to_q": ColwiseParallel(),
    "to_k": ColwiseParallel(),
    "to_v": ColwiseParallel(),
    "norm_q": HEAD_NORM,
    "norm_k": HEAD_NORM,
    "to_out.0": RowwiseParallel(),
}

# The single-stream block: heads and MLP hidden units split across ranks; both halves of proj_out leave partial sums
# that one all-reduce resolves. The optional cross-attention reads and adds to the column-sharded attention output:
# its query and output projections reduce-scatter their partial sums back onto each rank's heads.
SINGLE_BLOCK_TP_PLAN = {
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
    "proj_out.attn": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    "proj_out.mlp": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    "proj_out": PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
}

TP_PLANS = {
    MotifVideoSplitHeadsAttention: ATTENTION_TP_PLAN,
    MotifVideoSplitHeadsCrossAttention: CROSS_ATTENTION_TP_PLAN,
    MotifVideoUnfusedSingleTransformerBlock: SINGLE_BLOCK_TP_PLAN,
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
                rope_axes_dim=rope_axes(head_dim), text_embed_dim=64)


def _small(**config) -> dict:
    return dict(dict(in_channels=8, out_channels=4, text_embed_dim=24), **config)


# The first config is what the conformance suite shards (world 2 and 4): heads and MLP width divide by 4. Single-block
# cross-attention is sharded in tests/test_family_motif_video.py instead: the suite counts all-reduces only, and the
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
    tp_plans=TP_PLANS,
    all_reduces=_all_reduces,
    test_configs=TEST_CONFIGS,
    reduced=reduced,
)
