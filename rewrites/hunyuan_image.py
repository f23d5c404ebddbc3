"""HunyuanImage-2.1 (diffusers `HunyuanImageTransformer2DModel`): the single-stream block's fused output projection,
and attention that splits heads by head size so that it runs column-sharded.

| stock (diffusers)                            | rewritten (here)                            | slices              |
|----------------------------------------------|---------------------------------------------|---------------------|
| `HunyuanImageSingleTransformerBlock`         | `HunyuanImageUnfusedSingleTransformerBlock` | proj_out cols ->    |
|                                              | (proj_out a `SplitProjection`)              | proj_out.attn, .mlp |
| `Attention` with `HunyuanImageAttnProcessor` | `HunyuanImageSplitHeadsAttention`           | none                |

diffusers' `HunyuanImageAttnProcessor` reshapes with the stored head count (`unflatten(2, (attn.heads, -1))`), which is
wrong on a rank that holds `heads / N` of them; its twin here is the same code with `unflatten(2, (-1, head_dim))`.
Only attention modules running HunyuanImage's processor are rewritten: the token refiner's `Attention` (diffusers'
generic `AttnProcessor2_0`) stays replicated, its feed-forward is sharded by the shared `FeedForward` plan.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuanimage import (
    HunyuanImageAttnProcessor,
    HunyuanImageSingleTransformerBlock,
    HunyuanImageTransformer2DModel,
)
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel

from surgery.checks import SurgeryError
from surgery.registry import Family, Rewrite
from surgery.split_projection import fused_linear_like, split_projection_like, split_projection_slices
from surgery.tensor_parallel import per_head_norm


def recast(module: nn.Module, cls: type[nn.Module], **replace: nn.Module | dict[str, nn.Module]) -> nn.Module:
    """A new `cls` holding `module`'s attributes, parameters, buffers and children; `module` is left as it was.

    Each keyword names a child of `module` and gives what takes its place: a module (same name), or `{name: module}`
    for children under other names, in that order (`{}` drops the child). The order of children is kept, so that a
    rewrite and its inverse give back `named_modules()` in diffusers' order.

    The rewrites here change a module's class (its forward or processor) and a child or two; building the other form
    through its constructor would re-derive every attribute from init arguments the module does not keep.
    """
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    machinery = set(vars(new))
    vars(new).update({k: v for k, v in vars(module).items() if k not in machinery})
    new._parameters.update(module._parameters)
    new._buffers.update(module._buffers)
    new._non_persistent_buffers_set.update(module._non_persistent_buffers_set)
    for name, child in module._modules.items():
        place = replace.get(name, child)
        new._modules.update(place if isinstance(place, dict) else {name: place})
    new.training = module.training
    return new


class HunyuanImageSplitHeadsAttnProcessor(HunyuanImageAttnProcessor):
    """`HunyuanImageAttnProcessor` (diffusers 0.42.1) verbatim, heads split by `attn.head_dim` instead of counted."""

    def __call__(
        self,
        attn: "HunyuanImageSplitHeadsAttention",
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn.add_q_proj is None and encoder_hidden_states is not None:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

        # 1. QKV projections
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        query = query.unflatten(2, (-1, attn.head_dim))  # batch_size, seq_len, heads, head_dim
        key = key.unflatten(2, (-1, attn.head_dim))
        value = value.unflatten(2, (-1, attn.head_dim))

        # 2. QK normalization
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # 3. Rotational positional embeddings applied to latent stream
        if image_rotary_emb is not None:
            if attn.add_q_proj is None and encoder_hidden_states is not None:
                text = encoder_hidden_states.shape[1]
                query = torch.cat(
                    [apply_rotary_emb(query[:, :-text], image_rotary_emb, sequence_dim=1), query[:, -text:]], dim=1
                )
                key = torch.cat(
                    [apply_rotary_emb(key[:, :-text], image_rotary_emb, sequence_dim=1), key[:, -text:]], dim=1
                )
            else:
                query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
                key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        # 4. Encoder condition QKV projection and normalization
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

        # 5. Attention
        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        # 6. Output projection
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (
                hidden_states[:, : -encoder_hidden_states.shape[1]],
                hidden_states[:, -encoder_hidden_states.shape[1] :],
            )

            if getattr(attn, "to_out", None) is not None:
                hidden_states = attn.to_out[0](hidden_states)
                hidden_states = attn.to_out[1](hidden_states)

            if getattr(attn, "to_add_out", None) is not None:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

        return hidden_states, encoder_hidden_states


class HunyuanImageSplitHeadsAttention(Attention):
    """An `Attention` of HunyuanImage's blocks that runs `HunyuanImageSplitHeadsAttnProcessor`: same parameters, same
    outputs, and the same code runs whole or with its heads split across ranks."""

    @property
    def head_dim(self) -> int:
        return self.inner_dim // self.heads


class HunyuanImageUnfusedSingleTransformerBlock(HunyuanImageSingleTransformerBlock):
    """`HunyuanImageSingleTransformerBlock` whose `proj_out` is a `SplitProjection`: `proj_out(attn, mlp)` instead of
    `proj_out(cat([attn, mlp], dim=2))`. The forward is diffusers 0.42.1's otherwise."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        text_seq_length = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

        residual = hidden_states

        # 1. Input normalization
        norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
        mlp_hidden_states = self.act_mlp(self.proj_mlp(norm_hidden_states))

        norm_hidden_states, norm_encoder_hidden_states = (
            norm_hidden_states[:, :-text_seq_length, :],
            norm_hidden_states[:, -text_seq_length:, :],
        )

        # 2. Attention
        attn_output, context_attn_output = self.attn(
            hidden_states=norm_hidden_states,
            encoder_hidden_states=norm_encoder_hidden_states,
            attention_mask=attention_mask,
            image_rotary_emb=image_rotary_emb,
        )
        attn_output = torch.cat([attn_output, context_attn_output], dim=1)

        # 3. Modulation and residual connection
        hidden_states = gate.unsqueeze(1) * self.proj_out(attn_output, mlp_hidden_states)
        hidden_states = hidden_states + residual

        hidden_states, encoder_hidden_states = (
            hidden_states[:, :-text_seq_length, :],
            hidden_states[:, -text_seq_length:, :],
        )
        return hidden_states, encoder_hidden_states


# --- builders: the other form, sharing every child that is not a slice target ---------------------------------------


def _check_processor(attention: nn.Module, path: str, verb: str) -> None:
    expected = HunyuanImageAttnProcessor if type(attention) is Attention else HunyuanImageSplitHeadsAttnProcessor
    if type(attention.processor) is not expected:
        raise SurgeryError(
            f"surgery.{verb}: '{path}' runs a custom attention processor {type(attention.processor).__name__}; "
            f"{verb} would replace it. Set {expected.__name__} first (set_attn_processor), run surgery.{verb}, then "
            "install yours again."
        )


def _split_heads(attention: Attention) -> HunyuanImageSplitHeadsAttention:
    new = recast(attention, HunyuanImageSplitHeadsAttention)
    new.set_processor(HunyuanImageSplitHeadsAttnProcessor())
    return new


def _count_heads(attention: HunyuanImageSplitHeadsAttention) -> Attention:
    new = recast(attention, Attention)
    new.set_processor(HunyuanImageAttnProcessor())
    return new


def _check_single_block(block: nn.Module, path: str, verb: str) -> None:
    _check_processor(block.attn, f"{path}.attn", verb)


def _single_block_slices(block: nn.Module) -> list:
    return split_projection_slices("proj_out", block.proj_out, attn_features=block.attn.inner_dim)


def _unfuse_single_block(block: HunyuanImageSingleTransformerBlock) -> HunyuanImageUnfusedSingleTransformerBlock:
    return recast(
        block,
        HunyuanImageUnfusedSingleTransformerBlock,
        proj_out=split_projection_like(block.proj_out, block.attn.inner_dim),
        attn=_split_heads(block.attn),
    )


def _fuse_single_block(block: HunyuanImageUnfusedSingleTransformerBlock) -> HunyuanImageSingleTransformerBlock:
    return recast(
        block,
        HunyuanImageSingleTransformerBlock,
        proj_out=fused_linear_like(block.proj_out),
        attn=_count_heads(block.attn),
    )


REWRITES = (
    Rewrite(
        name="hunyuan_image.single_block",
        fused=HunyuanImageSingleTransformerBlock,
        unfused=HunyuanImageUnfusedSingleTransformerBlock,
        slices=_single_block_slices,
        build_unfused=_unfuse_single_block,
        build_fused=_fuse_single_block,
        check=_check_single_block,
    ),
    Rewrite(
        name="hunyuan_image.attention",
        fused=Attention,
        unfused=HunyuanImageSplitHeadsAttention,
        slices=lambda attention: [],
        build_unfused=_split_heads,
        build_fused=_count_heads,
        # only HunyuanImage's own: the generic class serves many families, told apart by their processor
        is_fused=lambda attention: type(attention.processor) is HunyuanImageAttnProcessor,
        check=_check_processor,
    ),
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
    HunyuanImageSplitHeadsAttention: ATTENTION_TP_PLAN,
    HunyuanImageUnfusedSingleTransformerBlock: SINGLE_BLOCK_TP_PLAN,
}


# --- the family: published configs, example inputs, test configs ----------------------------------------------------

_BASE = dict(
    in_channels=64, out_channels=64, num_attention_heads=28, attention_head_dim=128, num_layers=20,
    num_single_layers=40, num_refiner_layers=2, patch_size=(1, 1), qk_norm="rms_norm", text_embed_dim=3584,
    text_embed_2_dim=1472, rope_theta=256.0, rope_axes_dim=(64, 64),
)
VARIANTS = {
    "2.1": dict(_BASE, guidance_embeds=False),
    "2.1-distilled": dict(_BASE, guidance_embeds=True, use_meanflow=True),
    # the refiner takes 5-D latents (one frame): 26 heads, 128 input channels, no ByT5 stream
    "refiner": dict(
        in_channels=128, out_channels=64, num_layers=20, num_single_layers=40, rope_axes_dim=(16, 56, 56),
        num_attention_heads=26, attention_head_dim=128, mlp_ratio=4.0, patch_size=(1, 1, 1), text_embed_dim=3584,
        guidance_embeds=True,
    ),
}
_DEFAULTS = dict(in_channels=64, patch_size=(1, 1), text_embed_dim=3584)


def _grid(tokens: int, patch: tuple) -> tuple[int, ...]:
    """Latent sizes (frames, height, width or height, width) giving `tokens` patches."""
    height = max(d for d in range(1, math.isqrt(tokens) + 1) if tokens % d == 0)
    sizes = (height, tokens // height) if len(patch) == 2 else (1, height, tokens // height)
    return tuple(s * p for s, p in zip(sizes, patch))


def example_inputs(
    config: dict,
    batch: int = 1,
    image_tokens: int = 16,
    text_tokens: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict:
    """Seeded keyword arguments for `HunyuanImageTransformer2DModel.forward` at `config`. The last text token of the
    second sample is padding (masked); the ByT5 stream is left out (its token reordering indexes by mask values,
    which a meta forward cannot)."""
    config = dict(_DEFAULTS, **config)
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, text_tokens, dtype=torch.int64)
    if batch > 1 and text_tokens > 1:
        mask[1, -1] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, config["in_channels"], *_grid(image_tokens, config["patch_size"]),
                                  generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text_tokens, config["text_embed_dim"], generator=generator),
        encoder_attention_mask=mask,
        guidance=torch.full((batch,), 3500.0) if config.get("guidance_embeds") else None,
        timestep_r=torch.rand(batch, generator=generator) * 1000 if config.get("use_meanflow") else None,
    )
    floating = {"hidden_states", "timestep", "encoder_hidden_states", "guidance", "timestep_r"}
    return {
        k: None if v is None else v.to(device=device, dtype=dtype if k in floating else v.dtype)
        for k, v in inputs.items()
    }


def reduced(config: dict, layers: int = 2, single_layers: int = 4, head_dim: int = 32, refiner_layers: int = 1) -> dict:
    """A published config at demo size: same head count and MLP ratio; fewer blocks, smaller heads, narrow text."""
    axes = len(config.get("rope_axes_dim", (64, 64)))
    if head_dim % 2 or head_dim < 2 * axes:
        raise SurgeryError(f"head_dim {head_dim} cannot be split into {axes} rotary axes of even size")
    config = dict(config, num_layers=layers, num_single_layers=single_layers, attention_head_dim=head_dim,
                  num_refiner_layers=refiner_layers, text_embed_dim=64)
    # even rotary sizes that sum to head_dim, the larger ones last (as in the published (16, 56, 56))
    pairs = head_dim // 2
    config["rope_axes_dim"] = tuple(2 * (pairs // axes + (i >= axes - pairs % axes)) for i in range(axes))
    if config.get("text_embed_2_dim"):
        config["text_embed_2_dim"] = 32
    return config


def _small(**config) -> dict:
    return dict(dict(in_channels=8, out_channels=8, text_embed_dim=24, num_refiner_layers=0), **config)


# The first config is what the conformance suite shards (world 2 and 4): heads and MLP width divide by 4.
TEST_CONFIGS = {
    "tp_wide": _small(num_layers=1, num_single_layers=2, num_attention_heads=4, attention_head_dim=8,
                      rope_axes_dim=(4, 4), mlp_ratio=2.5, text_embed_2_dim=16),
    # the distilled checkpoint: guidance and the meanflow timestep embedding
    "distilled_small": _small(num_layers=1, num_single_layers=2, num_attention_heads=3, attention_head_dim=16,
                              rope_axes_dim=(8, 8), guidance_embeds=True, use_meanflow=True),
    # the refiner: 5-D latents, three rotary axes
    "refiner_small": _small(num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=12,
                            rope_axes_dim=(4, 4, 4), patch_size=(1, 1, 1), in_channels=16, guidance_embeds=True),
}

FAMILY = Family(
    name="hunyuan-image",
    model_class=HunyuanImageTransformer2DModel,
    variants=VARIANTS,
    sources="diffusers scripts/convert_hunyuan_image_to_diffusers.py (hunyuanimage2.1, hunyuanimage2.1-distilled, "
    "hunyuanimage-refiner transformer configs); tencent/HunyuanImage-2.1",
    default_variant="2.1",
    example_inputs=example_inputs,
    rewrites=REWRITES,
    tp_plans=TP_PLANS,
    # per double block: attention out + added out + ff + ff_context; per single block: one; per token-refiner block:
    # its feed-forward (the refiner's attention stays replicated)
    all_reduces=lambda config: 4 * config["num_layers"] + config["num_single_layers"]
    + config.get("num_refiner_layers", 2),
    test_configs=TEST_CONFIGS,
    reduced=reduced,
)
