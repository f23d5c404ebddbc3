"""HunyuanVideo (diffusers `HunyuanVideoTransformer3DModel`, text-to-video and both image-to-video variants).

Single-stream blocks, fused `proj_out(cat([attn, mlp], dim=2))` -> a `SplitProjection` (`proj_out` columns ->
`proj_out.attn`, with the bias, and `proj_out.mlp`):
    `HunyuanVideoSingleTransformerBlock` -> `HunyuanVideoUnfusedSingleTransformerBlock`
    `HunyuanVideoTokenReplaceSingleTransformerBlock` -> `HunyuanVideoUnfusedTokenReplaceSingleTransformerBlock`
Double-stream and token-refiner blocks, nothing sliced (their attention only, see below):
    `HunyuanVideoTransformerBlock` -> `HunyuanVideoHeadDimTransformerBlock`
    `HunyuanVideoTokenReplaceTransformerBlock` -> `HunyuanVideoHeadDimTokenReplaceTransformerBlock`
    `HunyuanVideoIndividualTokenRefinerBlock` -> `HunyuanVideoHeadDimTokenRefinerBlock`

Why the blocks without fused weights are rewritten too: every HunyuanVideo attention processor reshapes by the global
head count (`unflatten(2, (attn.heads, -1))` in `HunyuanVideoAttnProcessor2_0`; `view(batch, -1, attn.heads,
head_dim)` and a mask repeated `attn.heads` times in the refiner's `AttnProcessor2_0`). On a rank that holds a column
shard of q/k/v those split each head into pieces (or the sequence into pieces), so stock tensor parallelism would run
and be wrong. diffusers' own TP has no plan for this model; for the models it does shard (QwenImage, FLUX.2, ...) its
processors split by `head_dim` (`unflatten(-1, (-1, head_dim))`). Here each block's `attn` becomes a
`HunyuanVideoAttention`: the same module (same submodules, same attributes) whose processors are twins of the stock
ones that split by `head_dim`; nothing else changes, and `fuse` restores the stock classes and processors.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video import (
    HunyuanVideoAttnProcessor2_0,
    HunyuanVideoIndividualTokenRefinerBlock,
    HunyuanVideoSingleTransformerBlock,
    HunyuanVideoTokenReplaceSingleTransformerBlock,
    HunyuanVideoTokenReplaceTransformerBlock,
    HunyuanVideoTransformer3DModel,
    HunyuanVideoTransformerBlock,
)
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel

from surgery.checks import SurgeryError, mesh_sizes_dividing
from surgery.registry import Family, Rewrite
from surgery.split_projection import SplitProjection, fused_linear_like, split_projection_like, split_projection_slices
from surgery.tensor_parallel import per_head_norm

# --- attention processors that split heads by head_dim ---------------------------------------------------------------


class HunyuanVideoHeadDimAttnProcessor:
    """`HunyuanVideoAttnProcessor2_0` with heads split by `head_dim` (`unflatten(2, (-1, head_dim))`) instead of by
    `attn.heads`: the same computation on a whole module, and on each rank's share of the heads. Otherwise verbatim."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        head_dim = attn.inner_dim // attn.heads
        if attn.add_q_proj is None and encoder_hidden_states is not None:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

        # 1. QKV projections
        query = attn.to_q(hidden_states).unflatten(2, (-1, head_dim))
        key = attn.to_k(hidden_states).unflatten(2, (-1, head_dim))
        value = attn.to_v(hidden_states).unflatten(2, (-1, head_dim))

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
            encoder_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (-1, head_dim))
            encoder_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (-1, head_dim))
            encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (-1, head_dim))

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


class HunyuanVideoHeadDimRefinerAttnProcessor:
    """`AttnProcessor2_0` as the token refiner's self-attention runs it (3-d input, no spatial/group norm), with heads
    split by `head_dim`. Its mask, one per sample (`[batch, 1, queries, keys]`), is broadcast over the heads instead of
    repeated `attn.heads` times: the same mask for every head, on any number of them."""

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
    ) -> torch.Tensor:
        residual = hidden_states
        batch_size = hidden_states.shape[0]
        head_dim = attn.inner_dim // attn.heads
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)

        query = attn.to_q(hidden_states).unflatten(-1, (-1, head_dim)).transpose(1, 2)
        key = attn.to_k(encoder_hidden_states).unflatten(-1, (-1, head_dim)).transpose(1, 2)
        value = attn.to_v(encoder_hidden_states).unflatten(-1, (-1, head_dim)).transpose(1, 2)

        if attention_mask is not None:
            if attention_mask.shape[0] != batch_size or attention_mask.shape[-1] != key.shape[2]:
                raise ValueError(
                    f"{type(self).__name__} takes one mask per sample over all {key.shape[2]} keys; got a mask of "
                    f"shape {tuple(attention_mask.shape)}. Per-head or padded masks need the stock AttnProcessor2_0."
                )
            attention_mask = attention_mask.reshape(batch_size, 1, -1, attention_mask.shape[-1])

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        hidden_states = hidden_states.transpose(1, 2).flatten(2, 3).to(query.dtype)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)

        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


# Stock processor class <-> its head_dim twin; `set_processor` translates, so code that installs stock processors
# (set_attn_processor, attention backends) keeps working on the rewritten model.
_HEAD_DIM_PROCESSOR = {
    HunyuanVideoAttnProcessor2_0: HunyuanVideoHeadDimAttnProcessor,
    AttnProcessor2_0: HunyuanVideoHeadDimRefinerAttnProcessor,
}
_STOCK_PROCESSOR = {twin: stock for stock, twin in _HEAD_DIM_PROCESSOR.items()}


def _translate(processor, table: dict):
    """The same processor as an instance of its counterpart class, keeping its attention backend and parallel config."""
    counterpart = table.get(type(processor))
    if counterpart is None:
        return processor
    translated = counterpart.__new__(counterpart)
    translated.__dict__.update(processor.__dict__)
    return translated


class HunyuanVideoAttention(Attention):
    """diffusers' `Attention` as HunyuanVideo's blocks build it, running processors that split heads by `head_dim`.

    Same submodules and attributes (`heads`, `inner_dim` stay global sizes); a stock processor given to
    `set_processor` is swapped for its twin."""

    def set_processor(self, processor) -> None:
        super().set_processor(_translate(processor, _HEAD_DIM_PROCESSOR))


# --- the rewritten blocks ---------------------------------------------------------------------------------------------


class HunyuanVideoUnfusedSingleTransformerBlock(HunyuanVideoSingleTransformerBlock):
    """`HunyuanVideoSingleTransformerBlock` whose `proj_out` is a `SplitProjection`: `proj_out(attn, mlp)` instead of
    `proj_out(cat([attn, mlp], dim=2))`, and whose `attn` is a `HunyuanVideoAttention`. Forward otherwise verbatim."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        *args,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
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


class HunyuanVideoUnfusedTokenReplaceSingleTransformerBlock(HunyuanVideoTokenReplaceSingleTransformerBlock):
    """`HunyuanVideoTokenReplaceSingleTransformerBlock` (image-to-video, first-frame tokens modulated apart) with a
    `SplitProjection` `proj_out` and a `HunyuanVideoAttention`. Forward otherwise verbatim."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        token_replace_emb: torch.Tensor = None,
        num_tokens: int = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        text_seq_length = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

        residual = hidden_states

        # 1. Input normalization
        norm_hidden_states, gate, tr_gate = self.norm(hidden_states, temb, token_replace_emb, num_tokens)
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
        proj_output = self.proj_out(attn_output, mlp_hidden_states)
        hidden_states_zero = proj_output[:, :num_tokens] * tr_gate.unsqueeze(1)
        hidden_states_orig = proj_output[:, num_tokens:] * gate.unsqueeze(1)
        hidden_states = torch.cat([hidden_states_zero, hidden_states_orig], dim=1)
        hidden_states = hidden_states + residual

        hidden_states, encoder_hidden_states = (
            hidden_states[:, :-text_seq_length, :],
            hidden_states[:, -text_seq_length:, :],
        )
        return hidden_states, encoder_hidden_states


class HunyuanVideoHeadDimTransformerBlock(HunyuanVideoTransformerBlock):
    """`HunyuanVideoTransformerBlock` (double-stream) whose `attn` is a `HunyuanVideoAttention`; forward unchanged."""


class HunyuanVideoHeadDimTokenReplaceTransformerBlock(HunyuanVideoTokenReplaceTransformerBlock):
    """`HunyuanVideoTokenReplaceTransformerBlock` whose `attn` is a `HunyuanVideoAttention`; forward unchanged."""


class HunyuanVideoHeadDimTokenRefinerBlock(HunyuanVideoIndividualTokenRefinerBlock):
    """`HunyuanVideoIndividualTokenRefinerBlock` whose `attn` is a `HunyuanVideoAttention`; forward unchanged."""


# --- builders: the other form, sharing every submodule that is not a slice target -------------------------------------


def _twin(module: nn.Module, cls: type[nn.Module]) -> nn.Module:
    """`module` as an instance of `cls` (a subclass of its class, or the class it subclasses, with no state of its
    own): the same attributes and the same submodules, held in containers of its own, so that setting a submodule
    of the twin never touches `module`. torch has no such constructor, and `copy.copy` would share `_modules` itself;
    the stock constructors would rebuild (then discard) every submodule from arguments the blocks do not keep."""
    twin = cls.__new__(cls)
    twin.__dict__.update({k: copy.copy(v) if isinstance(v, (dict, set, list)) else v for k, v in vars(module).items()})
    return twin


def _attention_twin(attn: Attention, unfusing: bool) -> Attention:
    cls, table = (HunyuanVideoAttention, _HEAD_DIM_PROCESSOR) if unfusing else (Attention, _STOCK_PROCESSOR)
    twin = _twin(attn, cls)
    Attention.set_processor(twin, _translate(attn.processor, table))
    return twin


def _builder(cls: type[nn.Module], unfusing: bool):
    def build(block: nn.Module) -> nn.Module:
        twin = _twin(block, cls)
        twin.attn = _attention_twin(block.attn, unfusing)
        proj_out = getattr(block, "proj_out", None)  # single blocks only
        if isinstance(proj_out, SplitProjection):
            twin.proj_out = fused_linear_like(proj_out)
        elif proj_out is not None:  # a fused single block: its proj_out reads cat([attention, mlp])
            twin.proj_out = split_projection_like(proj_out, block.attn.inner_dim)
        return twin

    return build


def _single_block_slices(block: nn.Module) -> list:
    return split_projection_slices("proj_out", block.proj_out, attn_features=block.attn.inner_dim)


def _no_slices(block: nn.Module) -> list:
    return []


def _check_processor(block: nn.Module, path: str, verb: str) -> None:
    known = _HEAD_DIM_PROCESSOR if verb == "unfuse" else _STOCK_PROCESSOR
    processor = block.attn.processor
    if type(processor) not in known:
        raise SurgeryError(
            f"surgery.{verb}: '{path}.attn' uses a custom attention processor {type(processor).__name__}. Set one of "
            f"{[c.__name__ for c in known]} first (set_attn_processor), run surgery.{verb}, then install a processor "
            "that splits heads by head_dim if the model is to be sharded."
        )


def _rewrite(name: str, fused: type[nn.Module], unfused: type[nn.Module], slices) -> Rewrite:
    return Rewrite(
        name=f"hunyuan_video.{name}",
        fused=fused,
        unfused=unfused,
        slices=slices,
        build_unfused=_builder(unfused, unfusing=True),
        build_fused=_builder(fused, unfusing=False),
        check=_check_processor,
    )


REWRITES = (
    _rewrite("single_block", HunyuanVideoSingleTransformerBlock, HunyuanVideoUnfusedSingleTransformerBlock,
             _single_block_slices),
    _rewrite("token_replace_single_block", HunyuanVideoTokenReplaceSingleTransformerBlock,
             HunyuanVideoUnfusedTokenReplaceSingleTransformerBlock, _single_block_slices),
    _rewrite("double_block", HunyuanVideoTransformerBlock, HunyuanVideoHeadDimTransformerBlock, _no_slices),
    _rewrite("token_replace_double_block", HunyuanVideoTokenReplaceTransformerBlock,
             HunyuanVideoHeadDimTokenReplaceTransformerBlock, _no_slices),
    _rewrite("token_refiner_block", HunyuanVideoIndividualTokenRefinerBlock, HunyuanVideoHeadDimTokenRefinerBlock,
             _no_slices),
)

# --- tensor-parallel plans ----------------------------------------------------------------------------------------

# QK-norms act on each rank's own heads: the processors normalize [batch, seq, heads, head_dim].
HEAD_NORM = per_head_norm(2)

# Double-stream blocks and the token refiner (their FeedForwards use the shared plan): heads split across ranks, one
# all-reduce per output projection. Only the keys a module has apply (the refiner's attention has no added or norms).
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

# Single-stream blocks: heads and MLP hidden units split across ranks; the SplitProjection's halves leave partial sums,
# resolved once on its output (before the gate and the residual): one all-reduce per block. Planned as a whole block
# because `proj_mlp` is the block's own Linear; the `proj_out` entries are SplitProjection's plan.
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


def _check_single_block_heads(block: nn.Module, path: str, world: int) -> None:
    heads = block.attn.heads
    if heads % world:
        raise SurgeryError(
            f"surgery.tensor_parallel: '{path}.attn' has {heads} attention heads, which a mesh of {world} cannot split "
            f"evenly. Use a mesh size that divides {heads}: {mesh_sizes_dividing(heads)}."
        )


TP_PLANS = {
    HunyuanVideoAttention: ATTENTION_TP_PLAN,
    HunyuanVideoUnfusedSingleTransformerBlock: SINGLE_BLOCK_TP_PLAN,
    HunyuanVideoUnfusedTokenReplaceSingleTransformerBlock: SINGLE_BLOCK_TP_PLAN,
}
TP_CHECKS = {
    HunyuanVideoUnfusedSingleTransformerBlock: _check_single_block_heads,
    HunyuanVideoUnfusedTokenReplaceSingleTransformerBlock: _check_single_block_heads,
}

# --- the family: published configs, example inputs, test configs ------------------------------------------------------

# diffusers scripts/convert_hunyuan_video_to_diffusers.py TRANSFORMER_CONFIGS ("HYVideo-T/2-cfgdistill",
# "HYVideo-T/2-I2V-16ch", "HYVideo-T/2-I2V-33ch"); hunyuanvideo-community/HunyuanVideo transformer/config.json.
_T2V = dict(
    in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
    num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
    guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0,
    rope_axes_dim=(16, 56, 56), image_condition_type=None,
)
VARIANTS = {
    "t2v": _T2V,
    # HunyuanVideo-I2V, token-replace revision: first-frame tokens replaced by the image's and modulated at t=0
    "i2v": dict(_T2V, image_condition_type="token_replace"),
    # HunyuanVideo-I2V, first revision: image latents and a mask channel concatenated to the noise (16 * 2 + 1)
    "i2v-33ch": dict(_T2V, in_channels=33, guidance_embeds=False, image_condition_type="latent_concat"),
}


def video_grid(tokens: int) -> tuple[int, int, int]:
    """(frames, height, width) in latent patches with frames * height * width == tokens: two frames or more where
    the count allows (so the token-replace path has frames after the first), the rest as square as possible."""
    frames = 4 if tokens % 4 == 0 and tokens >= 64 else 2 if tokens % 2 == 0 else 1
    per_frame = tokens // frames
    height = max(d for d in range(1, math.isqrt(per_frame) + 1) if per_frame % d == 0)
    return frames, height, per_frame // height


def example_inputs(
    config: dict,
    batch: int = 1,
    image_tokens: int = 16,
    text_tokens: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict:
    """Seeded keyword arguments for `HunyuanVideoTransformer3DModel.forward`: a video latent of `image_tokens` patches
    (`video_grid`), `text_tokens` of text with the last one of every sample but the first masked as padding."""
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = video_grid(image_tokens)
    p, p_t = config.get("patch_size", 2), config.get("patch_size_t", 1)
    mask = torch.ones(batch, text_tokens, dtype=torch.bool)
    mask[1:, -1] = False
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), frames * p_t, height * p, width * p,
                                  generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_embed_dim", 4096), generator=generator),
        encoder_attention_mask=mask,
        pooled_projections=torch.randn(batch, config.get("pooled_projection_dim", 768), generator=generator),
        guidance=torch.full((batch,), 6000.0) if config.get("guidance_embeds", True) else None,
    )
    return {
        k: None if v is None else v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
        for k, v in inputs.items()
    }


def reduced(config: dict, layers: int = 2, single_layers: int = 4, head_dim: int = 32) -> dict:
    """A published config at demo size: same head count, MLP ratio and text width; fewer blocks, smaller heads."""
    if head_dim % 8:
        raise SurgeryError(f"head_dim {head_dim} is not a multiple of 8 (3 rotary axes of even size)")
    quarter = head_dim // 4
    return dict(config, num_layers=layers, num_single_layers=single_layers, attention_head_dim=head_dim,
                rope_axes_dim=(quarter, quarter, 2 * quarter))


def _small(**config) -> dict:
    rope = {8: (2, 2, 4), 12: (4, 4, 4), 16: (4, 6, 6)}[config["attention_head_dim"]]
    base = dict(in_channels=4, out_channels=4, num_refiner_layers=1, text_embed_dim=16, pooled_projection_dim=8)
    return dict(base, rope_axes_dim=rope, **config)


# The first one is sharded at world 2 and 4 (4 heads, widths 32 and 128).
TEST_CONFIGS = {
    "tp_small": _small(num_layers=1, num_single_layers=2, num_attention_heads=4, attention_head_dim=8),
    # HunyuanVideo-I2V (token replace): both token-replace block kinds
    "i2v_token_replace_small": _small(num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=12,
                                      image_condition_type="token_replace"),
    # HunyuanVideo-I2V-33ch (latent concat), no guidance, odd heads, fractional MLP ratio: int(48 * 2.5) = 120
    "i2v_latent_concat_small": _small(num_layers=1, num_single_layers=1, num_attention_heads=3,
                                      attention_head_dim=16, in_channels=9, mlp_ratio=2.5, guidance_embeds=False,
                                      image_condition_type="latent_concat"),
}

FAMILY = Family(
    name="hunyuan-video",
    model_class=HunyuanVideoTransformer3DModel,
    variants=VARIANTS,
    sources="diffusers scripts/convert_hunyuan_video_to_diffusers.py (TRANSFORMER_CONFIGS); "
    "hunyuanvideo-community/HunyuanVideo and HunyuanVideo-I2V transformer/config.json",
    default_variant="t2v",
    example_inputs=example_inputs,
    rewrites=REWRITES,
    tp_plans=TP_PLANS,
    tp_checks=TP_CHECKS,
    # per double block: attention out + added out + ff + ff_context; per single block: one (partial sums resolved
    # once); per token-refiner block: attention out + ff
    all_reduces=lambda config: 4 * config.get("num_layers", 20) + config.get("num_single_layers", 40)
    + 2 * config.get("num_refiner_layers", 2),
    test_configs=TEST_CONFIGS,
    reduced=reduced,
    aliases={"hunyuan-video": "t2v"},  # `--model hunyuan-video`: the text-to-video model
)
