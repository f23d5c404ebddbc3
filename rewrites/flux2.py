"""FLUX.2 (diffusers `Flux2Transformer2DModel`): the fused modules, their unfused forms and the slices between them.

| fused (diffusers)                       | unfused (here)                        | slices                                        |
|-----------------------------------------|---------------------------------------|-----------------------------------------------|
| `Flux2ParallelSelfAttention`            | `Flux2UnfusedParallelSelfAttention`   | to_qkv_mlp_proj rows -> to_q, to_k, to_v,     |
|   (single-stream `attn`)                |                                       |   mlp.linear_gate, mlp.linear_up;             |
|                                         |                                       | to_out cols -> to_out, mlp.linear_out         |
| `Flux2FeedForward` (`ff`, `ff_context`) | `Flux2UnfusedFeedForward`             | linear_in rows -> linear_gate, linear_up      |
| `Flux2Attention` after                  | `Flux2SplitQKVAttention`              | to_qkv rows -> to_q, to_k, to_v;              |
|   `fuse_qkv_projections()`              |                                       | to_added_qkv rows -> add_q/k/v_proj           |

Unfused forwards split heads by `head_dim` only, so the same code runs whole or column-sharded.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux2 import (
    Flux2Attention,
    Flux2FeedForward,
    Flux2KVLayerCache,
    Flux2KVParallelSelfAttnProcessor,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
    Flux2Transformer2DModel,
    _flux2_kv_causal_attention,
)
from einops import rearrange
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel

from surgery.checks import SurgeryError
from surgery.registry import Family, Rewrite
from surgery.slicing import Slice, column_slices, row_slices
from surgery.tensor_parallel import per_head_norm


class Flux2UnfusedFeedForward(nn.Module):
    """SwiGLU feed-forward with separate gate and up projections: `linear_out(silu(linear_gate(x)) * linear_up(x))`."""

    def __init__(
        self,
        dim: int,
        dim_out: int | None = None,
        mult: float = 3.0,
        inner_dim: int | None = None,
        bias: bool = False,
        out_bias: bool | None = None,
    ):
        super().__init__()
        inner_dim = inner_dim or int(dim * mult)
        self.linear_gate = nn.Linear(dim, inner_dim, bias=bias)
        self.linear_up = nn.Linear(dim, inner_dim, bias=bias)
        self.act_fn = nn.SiLU()
        self.linear_out = nn.Linear(inner_dim, dim_out or dim, bias=bias if out_bias is None else out_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_out(self.act_fn(self.linear_gate(x)) * self.linear_up(x))


# gate and up split the hidden units across ranks; linear_out all-reduces once.
FEED_FORWARD_TP_PLAN = {
    "linear_gate": ColwiseParallel(),
    "linear_up": ColwiseParallel(),
    "linear_out": RowwiseParallel(),
}


def _split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return rearrange(x, "b s (h d) -> b s h d", d=head_dim)


class Flux2UnfusedParallelSelfAttnProcessor:
    """`Flux2ParallelSelfAttnProcessor` for the unfused module: `to_out(attention) + mlp(x)`."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: "Flux2UnfusedParallelSelfAttention",
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return self._forward(attn, hidden_states, attention_mask, image_rotary_emb)

    def _forward(
        self,
        attn: "Flux2UnfusedParallelSelfAttention",
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None,
        kv_cache: Flux2KVLayerCache | None = None,
        kv_cache_mode: str | None = None,
        num_txt_tokens: int = 0,
        num_ref_tokens: int = 0,
    ) -> torch.Tensor:
        query = attn.norm_q(_split_heads(attn.to_q(hidden_states), attn.head_dim))
        key = attn.norm_k(_split_heads(attn.to_k(hidden_states), attn.head_dim))
        value = _split_heads(attn.to_v(hidden_states), attn.head_dim)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        if kv_cache_mode == "extract" and kv_cache is not None and num_ref_tokens > 0:
            ref = slice(num_txt_tokens, num_txt_tokens + num_ref_tokens)
            kv_cache.store(key[:, ref].clone(), value[:, ref].clone())

        if kv_cache_mode == "extract" and num_ref_tokens > 0:
            attended = _flux2_kv_causal_attention(
                query, key, value, num_txt_tokens, num_ref_tokens, backend=self._attention_backend
            )
        elif kv_cache_mode == "cached" and kv_cache is not None:
            attended = _flux2_kv_causal_attention(
                query, key, value, num_txt_tokens, 0, kv_cache=kv_cache, backend=self._attention_backend
            )
        else:
            attended = dispatch_attention_fn(
                query,
                key,
                value,
                attn_mask=attention_mask,
                backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
        attended = attended.flatten(2, 3).to(query.dtype)
        return attn.to_out(attended) + attn.mlp(hidden_states)


class Flux2UnfusedKVParallelSelfAttnProcessor(Flux2UnfusedParallelSelfAttnProcessor):
    """`Flux2KVParallelSelfAttnProcessor` for the unfused module (Klein KV-cache `extract` / `cached` modes)."""

    def __call__(
        self,
        attn: "Flux2UnfusedParallelSelfAttention",
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache: Flux2KVLayerCache | None = None,
        kv_cache_mode: str | None = None,
        num_txt_tokens: int = 0,
        num_ref_tokens: int = 0,
    ) -> torch.Tensor:
        return self._forward(
            attn, hidden_states, attention_mask, image_rotary_emb, kv_cache, kv_cache_mode, num_txt_tokens, num_ref_tokens
        )


# Stock processor class <-> the unfused module's equivalent; `set_processor` translates, so pipelines that install
# stock processors (the Klein KV pipeline does) keep working on the unfused model.
_UNFUSED_PROCESSOR = {
    Flux2ParallelSelfAttnProcessor: Flux2UnfusedParallelSelfAttnProcessor,
    Flux2KVParallelSelfAttnProcessor: Flux2UnfusedKVParallelSelfAttnProcessor,
}
_STOCK_PROCESSOR = {unfused: stock for stock, unfused in _UNFUSED_PROCESSOR.items()}


def _translate(processor, table: dict):
    """The same processor as an instance of its counterpart class, keeping its attention backend and parallel config."""
    counterpart = table.get(type(processor))
    if counterpart is None:
        return processor
    translated = counterpart.__new__(counterpart)
    translated.__dict__.update(processor.__dict__)
    return translated


class Flux2UnfusedParallelSelfAttention(nn.Module, AttentionModuleMixin):
    """`Flux2ParallelSelfAttention` with separate projections: q, k, v and a SwiGLU `mlp` run in parallel, summed.

    Same constructor, attributes (`heads`, `inner_dim`, `mlp_hidden_dim`, ... as global sizes) and call signature as
    the stock module. The fused `to_out` becomes `to_out` (attention columns, with the bias if any) + `mlp.linear_out`.
    """

    _default_processor_cls = Flux2UnfusedParallelSelfAttnProcessor
    _available_processors = [Flux2UnfusedParallelSelfAttnProcessor, Flux2UnfusedKVParallelSelfAttnProcessor]
    _supports_qkv_fusion = False

    def __init__(
        self,
        query_dim: int,
        heads: int = 8,
        dim_head: int = 64,
        dropout: float = 0.0,
        bias: bool = False,
        out_bias: bool = True,
        eps: float = 1e-5,
        out_dim: int | None = None,
        elementwise_affine: bool = True,
        mlp_ratio: float = 4.0,
        mlp_mult_factor: int = 2,
        processor=None,
    ):
        super().__init__()
        if mlp_mult_factor != 2:
            raise ValueError(f"mlp_mult_factor={mlp_mult_factor}: the unfused MLP is SwiGLU (gate, up), so it must be 2.")
        self.head_dim = dim_head
        self.inner_dim = out_dim if out_dim is not None else dim_head * heads
        self.query_dim = query_dim
        self.out_dim = out_dim if out_dim is not None else query_dim
        self.heads = out_dim // dim_head if out_dim is not None else heads
        self.use_bias = bias
        self.dropout = dropout
        self.mlp_ratio = mlp_ratio
        self.mlp_hidden_dim = int(query_dim * mlp_ratio)
        self.mlp_mult_factor = mlp_mult_factor

        self.to_q = nn.Linear(query_dim, self.inner_dim, bias=bias)
        self.to_k = nn.Linear(query_dim, self.inner_dim, bias=bias)
        self.to_v = nn.Linear(query_dim, self.inner_dim, bias=bias)
        self.norm_q = nn.RMSNorm(dim_head, eps=eps, elementwise_affine=elementwise_affine)
        self.norm_k = nn.RMSNorm(dim_head, eps=eps, elementwise_affine=elementwise_affine)
        self.to_out = nn.Linear(self.inner_dim, self.out_dim, bias=out_bias)
        self.mlp = Flux2UnfusedFeedForward(
            query_dim, self.out_dim, inner_dim=self.mlp_hidden_dim, bias=bias, out_bias=False
        )
        self.set_processor(processor if processor is not None else self._default_processor_cls())

    def set_processor(self, processor) -> None:
        """Install `processor`; a stock Flux2 single-stream processor is swapped for its unfused equivalent."""
        super().set_processor(_translate(processor, _UNFUSED_PROCESSOR))

    # The stock forward only filters kwargs by the processor's signature and calls it: reuse it as is.
    forward = Flux2ParallelSelfAttention.forward


# QK-norms act on each rank's own heads ([batch, seq, heads, head_dim]): replicated weights, gradients summed.
HEAD_NORM = per_head_norm(2)

# Heads and MLP hidden units split across ranks. Both output projections leave partial sums, and the module's output
# resolves their sum with one all-reduce: one collective per single-stream block.
PARALLEL_SELF_ATTENTION_TP_PLAN = {
    "to_q": ColwiseParallel(),
    "to_k": ColwiseParallel(),
    "to_v": ColwiseParallel(),
    "norm_q": HEAD_NORM,
    "norm_k": HEAD_NORM,
    "mlp.linear_gate": ColwiseParallel(),
    "mlp.linear_up": ColwiseParallel(),
    "to_out": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    "mlp.linear_out": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    "": PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
}


# The double-stream attention (stock, already unfused): heads split across ranks, one all-reduce per output projection.
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


class Flux2SplitQKVAttention(Flux2Attention):
    """A `Flux2Attention` whose `fuse_qkv_projections()` fusion was split back into to_q/to_k/to_v (and add_*_proj).

    It runs exactly as a stock, never-fused `Flux2Attention`; the class only records that `surgery.fuse` should
    restore `to_qkv` / `to_added_qkv`. diffusers' `fuse_qkv_projections()` is then a no-op (the projections count as
    fused already) and `unfuse_qkv_projections()` makes it a plain `Flux2Attention`, which `fuse` leaves alone: the
    same end state as on the stock model.
    """

    def fuse_projections(self) -> None:
        return None

    def unfuse_projections(self) -> None:
        # the same module, its fusion forgotten: a plain Flux2Attention with separate q/k/v (as stock unfusing leaves)
        self.__class__ = Flux2Attention
        self.fused_projections = False


# --- slices: which rows/columns of each fused parameter each unfused parameter is (for either form) ---------------


def _parallel_self_attention_slices(m: nn.Module) -> list[Slice]:
    inner, mlp = m.inner_dim, m.mlp_hidden_dim
    rows = [("to_q", inner), ("to_k", inner), ("to_v", inner), ("mlp.linear_gate", mlp), ("mlp.linear_up", mlp)]
    slices = row_slices("to_qkv_mlp_proj", rows, "weight")
    if m.use_bias:
        slices += row_slices("to_qkv_mlp_proj", rows, "bias")
    bias = m.to_out.bias is not None
    return slices + column_slices(
        "to_out", [("to_out", inner), ("mlp.linear_out", mlp)], "to_out" if bias else None, m.out_dim
    )


def _feed_forward_slices(m: nn.Module) -> list[Slice]:
    fused = isinstance(m, Flux2FeedForward)
    first = m.linear_in if fused else m.linear_gate
    hidden = first.out_features // 2 if fused else first.out_features
    rows = [("linear_gate", hidden), ("linear_up", hidden)]
    return row_slices("linear_in", rows, "weight") + (row_slices("linear_in", rows, "bias") if first.bias is not None else [])


def _split_qkv_slices(m: nn.Module) -> list[Slice]:
    inner = m.inner_dim
    slices = row_slices("to_qkv", [("to_q", inner), ("to_k", inner), ("to_v", inner)], "weight")
    if m.use_bias:
        slices += row_slices("to_qkv", [("to_q", inner), ("to_k", inner), ("to_v", inner)], "bias")
    if m.added_kv_proj_dim is not None:
        added = [("add_q_proj", inner), ("add_k_proj", inner), ("add_v_proj", inner)]
        slices += row_slices("to_added_qkv", added, "weight")
        if m.added_proj_bias:
            slices += row_slices("to_added_qkv", added, "bias")
    return slices


# --- builders: the other form's structure on meta, sharing every submodule that is not a slice target -------------


def _attention_kwargs(m: nn.Module) -> dict:
    return dict(
        query_dim=m.query_dim,
        heads=m.heads,
        dim_head=m.head_dim,
        dropout=m.dropout,
        bias=m.use_bias,
        eps=m.norm_q.eps,
        # stock semantics: a given out_dim also sets inner_dim
        out_dim=m.out_dim if m.inner_dim == m.out_dim else None,
        elementwise_affine=m.norm_q.weight is not None,
    )


def _parallel_self_attention_kwargs(m: nn.Module) -> dict:
    return dict(
        _attention_kwargs(m),
        out_bias=m.to_out.bias is not None,
        mlp_ratio=m.mlp_ratio,
        mlp_mult_factor=m.mlp_mult_factor,
    )


def _adopt(new: nn.Module, old: nn.Module, names: list[str]) -> nn.Module:
    for name in names:
        if hasattr(old, name):
            setattr(new, name, getattr(old, name))
    return new


def _unfuse_parallel_self_attention(m: Flux2ParallelSelfAttention) -> Flux2UnfusedParallelSelfAttention:
    with torch.device("meta"):
        new = Flux2UnfusedParallelSelfAttention(**_parallel_self_attention_kwargs(m), processor=m.processor)
    return _adopt(new, m, ["norm_q", "norm_k"])


def _fuse_parallel_self_attention(m: Flux2UnfusedParallelSelfAttention) -> Flux2ParallelSelfAttention:
    with torch.device("meta"):
        new = Flux2ParallelSelfAttention(
            **_parallel_self_attention_kwargs(m), processor=_translate(m.processor, _STOCK_PROCESSOR)
        )
    return _adopt(new, m, ["norm_q", "norm_k"])


def _check_processor(m: nn.Module, path: str, verb: str) -> None:
    known = _UNFUSED_PROCESSOR if isinstance(m, Flux2ParallelSelfAttention) else _STOCK_PROCESSOR
    if type(m.processor) not in known:
        raise SurgeryError(
            f"surgery.{verb}: '{path}' uses a custom attention processor {type(m.processor).__name__}, written for "
            f"the other form's projections. Set one of {[c.__name__ for c in known]} first (set_attn_processor), "
            f"run surgery.{verb}, then install a processor written for {type(m).__name__}'s counterpart."
        )


def _unfuse_feed_forward(m: Flux2FeedForward) -> Flux2UnfusedFeedForward:
    with torch.device("meta"):
        new = Flux2UnfusedFeedForward(
            m.linear_in.in_features,
            m.linear_out.out_features,
            inner_dim=m.linear_in.out_features // 2,
            bias=m.linear_in.bias is not None,
            out_bias=m.linear_out.bias is not None,
        )
    return _adopt(new, m, ["linear_out"])


def _fuse_feed_forward(m: Flux2UnfusedFeedForward) -> Flux2FeedForward:
    with torch.device("meta"):
        new = Flux2FeedForward(
            m.linear_gate.in_features,
            m.linear_out.out_features,
            inner_dim=m.linear_gate.out_features,
            bias=m.linear_gate.bias is not None,
        )
    return _adopt(new, m, ["linear_out"])


_ATTENTION_SHARED = ["norm_q", "norm_k", "to_out", "norm_added_q", "norm_added_k", "to_add_out"]
_ATTENTION_PROJECTIONS = ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"]


def _attention_kwargs_with_added(m: Flux2Attention) -> dict:
    return dict(
        _attention_kwargs(m),
        added_kv_proj_dim=m.added_kv_proj_dim,
        added_proj_bias=m.added_proj_bias,
        out_bias=m.to_out[0].bias is not None,
        processor=m.processor,
    )


def _split_qkv(m: Flux2Attention) -> Flux2SplitQKVAttention:
    with torch.device("meta"):
        new = Flux2SplitQKVAttention(**_attention_kwargs_with_added(m))
    return _adopt(new, m, _ATTENTION_SHARED)


def _join_qkv(m: Flux2SplitQKVAttention) -> Flux2Attention:
    with torch.device("meta"):
        new = Flux2Attention(**_attention_kwargs_with_added(m))
        new.to_qkv = nn.Linear(m.query_dim, 3 * m.inner_dim, bias=m.use_bias)
        if m.added_kv_proj_dim is not None:
            new.to_added_qkv = nn.Linear(m.added_kv_proj_dim, 3 * m.inner_dim, bias=m.added_proj_bias)
    new.fused_projections = True
    return _adopt(new, m, _ATTENTION_SHARED + _ATTENTION_PROJECTIONS)


REWRITES = (
    Rewrite(
        name="flux2.parallel_self_attention",
        fused=Flux2ParallelSelfAttention,
        unfused=Flux2UnfusedParallelSelfAttention,
        slices=_parallel_self_attention_slices,
        build_unfused=_unfuse_parallel_self_attention,
        build_fused=_fuse_parallel_self_attention,
        check=_check_processor,
    ),
    Rewrite(
        name="flux2.feed_forward",
        fused=Flux2FeedForward,
        unfused=Flux2UnfusedFeedForward,
        slices=_feed_forward_slices,
        build_unfused=_unfuse_feed_forward,
        build_fused=_fuse_feed_forward,
    ),
    Rewrite(
        name="flux2.fused_qkv_attention",
        fused=Flux2Attention,
        unfused=Flux2SplitQKVAttention,
        slices=_split_qkv_slices,
        build_unfused=_split_qkv,
        build_fused=_join_qkv,
        is_fused=lambda m: bool(getattr(m, "fused_projections", False)),
        in_checkpoints=False,
    ),
)

TP_PLANS = {
    Flux2Attention: ATTENTION_TP_PLAN,
    Flux2SplitQKVAttention: ATTENTION_TP_PLAN,
    Flux2UnfusedFeedForward: FEED_FORWARD_TP_PLAN,
    Flux2UnfusedParallelSelfAttention: PARALLEL_SELF_ATTENTION_TP_PLAN,
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
CONFIGS = VARIANTS  # the name older scripts and notebooks import


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
    tp_plans=TP_PLANS,
    # per double block: attention out + added out + ff + ff_context; per single block: one (partial sums resolved once)
    all_reduces=lambda config: 4 * config["num_layers"] + config["num_single_layers"],
    test_configs=TEST_CONFIGS,
    reduced=reduced,
    aliases={"klein-4b": "klein-4b", "klein-9b": "klein-9b", "dev": "dev"},
)


def seeded_model(config: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> Flux2Transformer2DModel:
    """`Flux2Transformer2DModel(**config)` with every weight drawn from `seed` (see `surgery.testing.seeded_model`)."""
    from surgery.testing import seeded_model as seeded

    return seeded(FAMILY, config, seed, dtype)
