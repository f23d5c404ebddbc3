"""LongCat-Image (diffusers `LongCatImageTransformer2DModel`): the single-stream block's fused output projection, and
attention that splits heads by head size so that it runs column-sharded.

| stock (diffusers)                    | rewritten (here)                            | slices                       |
|--------------------------------------|---------------------------------------------|------------------------------|
| `LongCatImageSingleTransformerBlock` | `LongCatImageUnfusedSingleTransformerBlock` | proj_out cols -> .attn, .mlp |
|                                      | (proj_out a `SplitProjection`)              |                              |
| `LongCatImageAttention`              | `LongCatImageSplitHeadsAttention`           | none                         |

diffusers' `LongCatImageAttnProcessor` reshapes with the stored head count (`unflatten(-1, (attn.heads, -1))`), wrong
on a rank that holds `heads / N` of them. `SplitHeadsJointAttnProcessor` is the same code with `(-1, attn.head_dim)`;
diffusers copied that processor verbatim into Ovis-Image, Bria and Bria-Fibo, whose files here reuse it and the
builders below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_longcat_image import (
    LongCatImageAttention,
    LongCatImageAttnProcessor,
    LongCatImageSingleTransformerBlock,
    LongCatImageTransformer2DModel,
)
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel

from rewrites.hunyuan_image import recast
from surgery.checks import SurgeryError
from surgery.registry import Family, Rewrite
from surgery.split_projection import fused_linear_like, split_projection_like, split_projection_slices
from surgery.tensor_parallel import per_head_norm


class SplitHeadsJointAttnProcessor:
    """The joint-attention processor diffusers 0.42.1 ships as `LongCatImageAttnProcessor` (and, verbatim, Ovis-Image's,
    Bria's and Bria-Fibo's), heads split by `attn.head_dim` instead of counted. Projections are separate (to_q, to_k,
    to_v): the rewrites refuse modules fused with `fuse_projections()`."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        query = attn.to_q(hidden_states).unflatten(-1, (-1, attn.head_dim))
        key = attn.to_k(hidden_states).unflatten(-1, (-1, attn.head_dim))
        value = attn.to_v(hidden_states).unflatten(-1, (-1, attn.head_dim))

        query = attn.norm_q(query)
        key = attn.norm_k(key)

        if attn.added_kv_proj_dim is not None:
            encoder_query = attn.add_q_proj(encoder_hidden_states).unflatten(-1, (-1, attn.head_dim))
            encoder_key = attn.add_k_proj(encoder_hidden_states).unflatten(-1, (-1, attn.head_dim))
            encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(-1, (-1, attn.head_dim))

            encoder_query = attn.norm_added_q(encoder_query)
            encoder_key = attn.norm_added_k(encoder_key)

            query = torch.cat([encoder_query, query], dim=1)
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

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
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1
            )
            hidden_states = attn.to_out[0](hidden_states.contiguous())
            hidden_states = attn.to_out[1](hidden_states)
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())

            return hidden_states, encoder_hidden_states
        else:
            return hidden_states


class LongCatImageSplitHeadsAttention(LongCatImageAttention):
    """A `LongCatImageAttention` running `SplitHeadsJointAttnProcessor`: same parameters, same outputs, whole or with
    its heads split across ranks."""

    _default_processor_cls = SplitHeadsJointAttnProcessor
    _available_processors = [SplitHeadsJointAttnProcessor]


class LongCatImageUnfusedSingleTransformerBlock(LongCatImageSingleTransformerBlock):
    """`LongCatImageSingleTransformerBlock` whose `proj_out` is a `SplitProjection`: `proj_out(attn, mlp)` instead of
    `proj_out(cat([attn, mlp], dim=2))`. The forward is diffusers 0.42.1's otherwise."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        joint_attention_kwargs: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

        residual = hidden_states
        norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
        mlp_hidden_states = self.act_mlp(self.proj_mlp(norm_hidden_states))
        joint_attention_kwargs = joint_attention_kwargs or {}
        attn_output = self.attn(
            hidden_states=norm_hidden_states,
            image_rotary_emb=image_rotary_emb,
            **joint_attention_kwargs,
        )

        gate = gate.unsqueeze(1)
        hidden_states = gate * self.proj_out(attn_output, mlp_hidden_states)
        hidden_states = residual + hidden_states
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)

        encoder_hidden_states, hidden_states = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
        return encoder_hidden_states, hidden_states


# --- rewrites for a FLUX-like family: its attention class and processor, its single-stream block -------------------


def attention_rewrite(
    name: str, stock: type, twin: type, stock_processor: type, shared: bool = False,
    twin_processor: type = SplitHeadsJointAttnProcessor,
) -> Rewrite:
    """`stock` attention (running `stock_processor`) <-> `twin` (running `twin_processor`): no slices.

    `shared`: `stock` serves other families too (diffusers' generic `Attention`); only the modules running
    `stock_processor` are this family's, the others are left to their own families.
    """

    def check(attention: nn.Module, path: str, verb: str) -> None:
        expected = stock_processor if type(attention) is stock else twin_processor
        if type(attention.processor) is not expected:
            raise SurgeryError(
                f"surgery.{verb}: '{path}' runs a custom attention processor {type(attention.processor).__name__}; "
                f"{verb} would replace it. Set {expected.__name__} first (set_attn_processor), run surgery.{verb}, "
                "then install yours again."
            )
        if getattr(attention, "fused_projections", False):
            raise SurgeryError(
                f"surgery.{verb}: '{path}' has fused q/k/v projections (fuse_projections); call "
                f"unfuse_qkv_projections() on the model first, then surgery.{verb}."
            )

    def split_heads(attention: nn.Module) -> nn.Module:
        new = recast(attention, twin)
        new.set_processor(twin_processor())
        return new

    def count_heads(attention: nn.Module) -> nn.Module:
        new = recast(attention, stock)
        new.set_processor(stock_processor())
        return new

    return Rewrite(
        name=name,
        fused=stock,
        unfused=twin,
        slices=lambda attention: [],
        build_unfused=split_heads,
        build_fused=count_heads,
        is_fused=(lambda attention: type(attention.processor) is stock_processor) if shared else (lambda a: True),
        check=check,
    )


@dataclass(frozen=True)
class MLPSplit:
    """How a single-stream block's fused `proj_mlp` splits (Ovis-Image's gated MLP): `slices(block)`, and the children
    that take `proj_mlp`'s place either way, as `recast` keywords: `unfused(block)`, `fused(block)`."""

    slices: Callable[[nn.Module], list]
    unfused: Callable[[nn.Module], dict]
    fused: Callable[[nn.Module], dict]


def single_block_rewrite(
    name: str, stock: type, unfused: type, attention: Rewrite, mlp: MLPSplit | None = None,
    nested: dict[str, Rewrite] | None = None,
) -> Rewrite:
    """`stock` single-stream block <-> `unfused`: proj_out split by columns into a `SplitProjection`; the block's
    `attn` converted by the `attention` rewrite, its `proj_mlp` by `mlp` where that is fused too, and any other child
    named in `nested` (where the block has one) by its rewrite."""
    nested = dict(nested or {})

    def children(block: nn.Module, unfusing: bool) -> dict:
        found = {name: (getattr(block, name), rewrite) for name, rewrite in nested.items()}
        return {
            name: rewrite.build_unfused(child) if unfusing else rewrite.build_fused(child)
            for name, (child, rewrite) in found.items() if child is not None
        }

    def check(block: nn.Module, path: str, verb: str) -> None:
        attention.check(block.attn, f"{path}.attn", verb)
        for name, rewrite in nested.items():
            if getattr(block, name) is not None:
                rewrite.check(getattr(block, name), f"{path}.{name}", verb)

    def slices(block: nn.Module) -> list:
        out = split_projection_slices("proj_out", block.proj_out, attn_features=block.attn.inner_dim)
        return (mlp.slices(block) if mlp else []) + out

    def unfuse_block(block: nn.Module) -> nn.Module:
        extra = dict(mlp.unfused(block) if mlp else {}, **children(block, unfusing=True))
        return recast(
            block,
            unfused,
            proj_out=split_projection_like(block.proj_out, block.attn.inner_dim),
            attn=attention.build_unfused(block.attn),
            **extra,
        )

    def fuse_block(block: nn.Module) -> nn.Module:
        extra = dict(mlp.fused(block) if mlp else {}, **children(block, unfusing=False))
        return recast(
            block, stock, proj_out=fused_linear_like(block.proj_out), attn=attention.build_fused(block.attn), **extra
        )

    return Rewrite(
        name=name, fused=stock, unfused=unfused, slices=slices, build_unfused=unfuse_block, build_fused=fuse_block,
        check=check,
    )


_ATTENTION = attention_rewrite(
    "longcat_image.attention", LongCatImageAttention, LongCatImageSplitHeadsAttention, LongCatImageAttnProcessor
)
REWRITES = (
    single_block_rewrite(
        "longcat_image.single_block", LongCatImageSingleTransformerBlock, LongCatImageUnfusedSingleTransformerBlock,
        _ATTENTION,
    ),
    _ATTENTION,
)


# --- tensor-parallel plans ------------------------------------------------------------------------------------------

# QK-norms act on each rank's own heads ([batch, seq, heads, head_dim]).
HEAD_NORM = per_head_norm(2)

# The double-stream block's attention: heads split across ranks, one all-reduce per output projection.
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

# The single-stream block: heads and MLP hidden units split across ranks; both halves of proj_out leave partial sums
# that one all-reduce resolves (SplitProjection's plan, written out here because the block is planned as a whole).
SINGLE_BLOCK_TP_PLAN = {
    "attn.to_q": ColwiseParallel(),
    "attn.to_k": ColwiseParallel(),
    "attn.to_v": ColwiseParallel(),
    "attn.norm_q": HEAD_NORM,
    "attn.norm_k": HEAD_NORM,
    "proj_mlp": ColwiseParallel(),
    "proj_out.attn": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    "proj_out.mlp": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    "proj_out": PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
}

TP_PLANS = {
    LongCatImageSplitHeadsAttention: ATTENTION_TP_PLAN,
    LongCatImageUnfusedSingleTransformerBlock: SINGLE_BLOCK_TP_PLAN,
}


# --- the family: published configs, example inputs, test configs ----------------------------------------------------

# meituan-longcat/LongCat-Image and LongCat-Image-Edit share one transformer config, equal to the class defaults
# (19 double / 38 single blocks, 24 heads of 128, Qwen2.5-VL-7B text width 3584, rotary axes (16, 56, 56)).
VARIANTS = {
    "base": dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=3584, pooled_projection_dim=3584, axes_dims_rope=(16, 56, 56),
    ),
}


def flux_like_inputs(
    config: dict,
    batch: int = 1,
    image_tokens: int = 16,
    text_tokens: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **defaults,
) -> dict:
    """Seeded FLUX.1-style keyword arguments (packed latents, text states, timestep in [0, 1), position ids of
    3 axes) for a model at `config`, with `defaults` for sizes the config leaves out."""
    config = dict(defaults, **config)
    generator = torch.Generator().manual_seed(seed)
    axes = len(config["axes_dims_rope"])
    inputs = dict(
        hidden_states=torch.randn(batch, image_tokens, config["in_channels"], generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config["joint_attention_dim"], generator=generator),
        timestep=torch.rand(batch, generator=generator),
        img_ids=torch.randint(0, 64, (image_tokens, axes), generator=generator),
        txt_ids=torch.randint(0, 64, (text_tokens, axes), generator=generator),
    )
    floating = {"hidden_states", "encoder_hidden_states", "timestep"}
    return {k: v.to(device=device, dtype=dtype if k in floating else v.dtype) for k, v in inputs.items()}


def example_inputs(config: dict, **kwargs) -> dict:
    """Seeded keyword arguments for `LongCatImageTransformer2DModel.forward` at `config`."""
    return flux_like_inputs(config, **kwargs, in_channels=64, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))


def rope_axes(head_dim: int, axes: int = 3) -> tuple[int, ...]:
    """Even rotary sizes summing to `head_dim`, the larger ones last (as in the published (16, 56, 56))."""
    if head_dim % 2 or head_dim < 2 * axes:
        raise SurgeryError(f"head_dim {head_dim} cannot be split into {axes} rotary axes of even size")
    pairs = head_dim // 2
    return tuple(2 * (pairs // axes + (i >= axes - pairs % axes)) for i in range(axes))


def reduced(config: dict, layers: int = 2, single_layers: int = 4, head_dim: int = 32) -> dict:
    """A published config at demo size: same head count; fewer blocks, smaller heads, narrow text states."""
    return dict(config, num_layers=layers, num_single_layers=single_layers, attention_head_dim=head_dim,
                axes_dims_rope=rope_axes(head_dim), joint_attention_dim=64, pooled_projection_dim=64)


def _small(**config) -> dict:
    return dict(dict(in_channels=8, joint_attention_dim=24, pooled_projection_dim=24), **config)


# The first config is what the conformance suite shards (world 2 and 4): heads and MLP width divide by 4.
TEST_CONFIGS = {
    "tp_wide": _small(num_layers=1, num_single_layers=2, num_attention_heads=4, attention_head_dim=8,
                      axes_dims_rope=(2, 2, 4)),
    # 24 heads -> 3, two single blocks per double block as published
    "odd_heads": _small(num_layers=1, num_single_layers=2, num_attention_heads=3, attention_head_dim=12,
                        axes_dims_rope=(4, 4, 4)),
}

FAMILY = Family(
    name="longcat-image",
    model_class=LongCatImageTransformer2DModel,
    variants=VARIANTS,
    sources="LongCatImageTransformer2DModel defaults (diffusers 0.42.1), which meituan-longcat/LongCat-Image and "
    "LongCat-Image-Edit transformer/config.json use",
    default_variant="base",
    example_inputs=example_inputs,
    rewrites=REWRITES,
    tp_plans=TP_PLANS,
    # per double block: attention out + added out + ff + ff_context; per single block: one
    all_reduces=lambda config: 4 * config["num_layers"] + config["num_single_layers"],
    test_configs=TEST_CONFIGS,
    reduced=reduced,
)
