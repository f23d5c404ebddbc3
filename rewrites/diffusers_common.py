"""What diffusers' model families share: the stock tensor-parallel plans written once, for every family to reference.

`diffusers.models.attention.FeedForward` with a plain activation (GELU, tanh-GELU, approximate GELU, SiLU): the
up projection column-sharded, the down projection rowwise (one all-reduce). Its gated variants (GEGLU, SwiGLU) fuse
gate and up in `net.0.proj`: `GEGLU_ROWS` splits GEGLU's into its hidden and gate rows (a `rows` leaf: its stock
`chunk(2)` reads each rank's halves), whose feed-forward is then derived (two Linears colwise, the down projection
rowwise); a family that uses SwiGLU rewrites it (rewrites/ovis_image.py). It is registered here, once, because the
classes are diffusers' own.

The other plans here are literal dicts that several families register for their own classes, which share diffusers'
attention layout (`to_q`, `add_q_proj`, `norm_added_q`, ...): `ATTENTION_TP_PLAN`, `DOUBLE_STREAM_ATTENTION_TP_PLAN`
and FLUX.1's single-stream block, `SINGLE_BLOCK_TP_PLAN`. diffusers' generic `Attention` is registered (with the
double-stream plan) in rewrites/qwenimage.py, for the processors that split heads by head_dim: QwenImage's and the
head-dim twins of `surgery.core.leaves`.

`surgery.parallel.styles.SPLIT_PROJECTION_TP_PLAN` is not registered by class: the blocks that hold a
`SplitProjection` compose it under its path in their own literal plans (`surgery.parallel.styles.under`).

The rest is what several family files share beyond plans, kept here so that no family file imports another's
(except where diffusers' own module imports the other: chroma from flux, hunyuan_video_framepack from
hunyuan_video): the undo of diffusers' `fuse_qkv_projections()` (`fused_qkv_rewrite`), the FLUX-like single block's rewrites and inputs (LongCat-Image, Ovis-Image, Bria, Bria-Fibo,
Motif-Video), the generic `Attention`'s processors (`GENERIC`), one `cast_inputs`, and the published numbers and
example inputs of models built alike (Wan's for SkyReels-V2, ChronoEdit, Wan-VACE, Wan-Animate and AnyFlow;
CogVideoX's for ConsisID; LTX-2's for SANA-WM's refiner; Sana's for Sana-Video), a fused projection's rows as a
leaf (`qkv_rows`: JoyImage, PRX, Stable Audio 3) and JoyImage-Edit's family, which diffusers writes in two files
(Edit and Edit-Plus).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
from diffusers.models.activations import GEGLU, SwiGLU
from diffusers.models.attention import FeedForward
from diffusers.models.attention_processor import (
    AttnProcessor2_0,
    CogVideoXAttnProcessor2_0,
    HunyuanAttnProcessor2_0,
    JointAttnProcessor2_0,
    LuminaAttnProcessor2_0,
)
from diffusers.models.embeddings import get_3d_rotary_pos_embed
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery.core.errors import SurgeryError
from surgery.core.leaves import Leaf, recast
from surgery.core.slicing import row_slices
from surgery.core.split_projection import SplitLeaf
from surgery.extend import (
    Family, Processors, Rewrite, TensorParallel, Tests, columns, derived_family, register_edits, rows, swap_rewrite,
)
from surgery.parallel.derive import per_head_norm
from surgery.parallel.styles import SPLIT_PROJECTION_TP_PLAN, under

# QK-norms act on each rank's own heads ([batch, seq, heads, head_dim]): replicated weights, gradients summed.
HEAD_NORM = per_head_norm(2)

# An attention with one stream (to_q / to_k / to_v, QK-norms, to_out): heads split across ranks, one all-reduce for
# the output projection.
ATTENTION_TP_PLAN = {
    "to_q": ColwiseParallel(),
    "to_k": ColwiseParallel(),
    "to_v": ColwiseParallel(),
    "norm_q": HEAD_NORM,
    "norm_k": HEAD_NORM,
    "to_out.0": RowwiseParallel(),
}

# The double-stream (joint) attention: the image stream's projections and the text stream's (add_*_proj,
# norm_added_*, to_add_out), heads split across ranks; one all-reduce per output projection. Only the keys a module
# has apply (a `pre_only` attention has no to_out).
DOUBLE_STREAM_ATTENTION_TP_PLAN = {
    **ATTENTION_TP_PLAN,
    "add_q_proj": ColwiseParallel(),
    "add_k_proj": ColwiseParallel(),
    "add_v_proj": ColwiseParallel(),
    "norm_added_q": HEAD_NORM,
    "norm_added_k": HEAD_NORM,
    "to_add_out": RowwiseParallel(),
}

# FLUX.1's single-stream block (and its likes: attention without to_out, a plain `proj_mlp`, `proj_out` reading
# cat([attention, MLP]) unfused into a SplitProjection): heads and MLP hidden units split across ranks; both parts of
# proj_out leave partial sums, resolved by one all-reduce at its output (before the gate and the residual): one
# collective per block. The block is planned whole (its proj_mlp is the block's own Linear), so the attention's
# entries are spelled out here and proj_out's are the shared SplitProjection plan.
SINGLE_BLOCK_TP_PLAN = {
    "attn.to_q": ColwiseParallel(),
    "attn.to_k": ColwiseParallel(),
    "attn.to_v": ColwiseParallel(),
    "attn.norm_q": HEAD_NORM,
    "attn.norm_k": HEAD_NORM,
    "proj_mlp": ColwiseParallel(),
    **under("proj_out", SPLIT_PROJECTION_TP_PLAN),
}

FEED_FORWARD_TP_PLAN = {
    "net.0.proj": ColwiseParallel(),
    "net.2": RowwiseParallel(),
}


def qkv_rows(name: str, width: Callable[[nn.Module], int], parts: tuple[str, ...] = ("q", "k", "v")) -> Leaf:
    """A fused projection Linear `name` whose rows are `parts` (Q, K, V; or K, V) of `width(module)` rows each, in
    that order: a `rows` leaf with those parts (views). Each rank's `SplitRows` returns `cat([q, k, v], -1)` of its
    own heads, so a processor that reads the fused output as `chunk(3)` or as `(3, heads, head_dim)` reads that
    rank's heads (a `(heads, 3, head_dim)` reading would not)."""
    return rows(name, lambda m: [(part, width(m)) for part in parts])


def _check_feed_forward(module: nn.Module, path: str, world: int) -> None:
    activation = module.net[0]
    if isinstance(activation, (GEGLU, SwiGLU)):
        raise SurgeryError(
            f"surgery.tensor_parallel: '{path}.net.0' is a {type(activation).__name__}, whose `proj` fuses gate and up "
            "rows; column sharding would cut across them. Its model family needs a rewrite that splits them first."
        )



# --- the FLUX-like single block (LongCat-Image, Ovis-Image, Bria, Bria-Fibo, Motif-Video) ---------------------------

# The single block's proj_out reads cat([attention output, MLP hidden]): its first columns are the attention's.
PROJ_OUT = columns("proj_out", lambda block: block.attn.inner_dim)


def flux_like_rewrites(
    prefix: str,
    single_block: type[nn.Module],
    attention: type[nn.Module],
    processors: Processors,
    single_attention: Processors | None = None,
    leaves: tuple[Leaf, ...] = (),
    children: dict | None = None,
    unfused_single_block: type[nn.Module] | None = None,
) -> tuple[Rewrite, ...]:
    """A FLUX-like family's rewrites: the single block's `proj_out` (and any other `leaves`) swapped, its `attn`'s
    processor (`single_attention`, default `processors`) swapped for the head-dim twin, and the double blocks'
    `attention` modules' processors likewise."""
    single_attention = single_attention or processors
    return (
        swap_rewrite(f"{prefix}.single_block", single_block, leaves=(*leaves, PROJ_OUT),
                     children={"attn": single_attention, **(children or {})}, unfused_class=unfused_single_block),
        swap_rewrite(f"{prefix}.attention", attention, processors=processors),
    )


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


def balanced_rope_axes(head_dim: int, axes: int = 3) -> tuple[int, ...]:
    """Even rotary sizes summing to `head_dim`, the larger ones last (as in the published (16, 56, 56))."""
    if head_dim % 2 or head_dim < 2 * axes:
        raise SurgeryError(f"head_dim {head_dim} cannot be split into {axes} rotary axes of even size")
    pairs = head_dim // 2
    return tuple(2 * (pairs // axes + (i >= axes - pairs % axes)) for i in range(axes))


def reduced(config: dict, layers: int = 2, single_layers: int = 4, head_dim: int = 32) -> dict:
    """A published config at demo size: same head count; fewer blocks, smaller heads, narrow text states."""
    return dict(config, num_layers=layers, num_single_layers=single_layers, attention_head_dim=head_dim,
                axes_dims_rope=balanced_rope_axes(head_dim), joint_attention_dim=64, pooled_projection_dim=64)


# --- example inputs and published numbers several families share ---------------------------------------------------

def video_grid(tokens: int) -> tuple[int, int, int]:
    """(frames, height, width) in latent patches with frames * height * width == tokens: two frames or more where
    the count allows (so the token-replace path has frames after the first), the rest as square as possible."""
    frames = 4 if tokens % 4 == 0 and tokens >= 64 else 2 if tokens % 2 == 0 else 1
    per_frame = tokens // frames
    height = max(d for d in range(1, math.isqrt(per_frame) + 1) if per_frame % d == 0)
    return frames, height, per_frame // height


def wan_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `WanTransformer3DModel.forward`: a video latent of `image_tokens` patches; for an
    image-to-video config (`image_dim`), 16 image-embedding tokens (the published models take CLIP's 257; with very
    few, the image cross-attention's key gradients are differences of near-equal terms, whose fp32 rounding decides
    them), and the text padded to the 512 tokens its cross attention expects (the image tokens are what precedes the
    last 512)."""
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = video_grid(image_tokens)
    p_t, p_h, p_w = config.get("patch_size", (1, 2, 2))
    text = 512 if config.get("image_dim") else text_tokens
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), frames * p_t, height * p_h, width * p_w,
                                  generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states=torch.randn(batch, text, config.get("text_dim", 4096), generator=generator),
    )
    if config.get("image_dim"):
        inputs["encoder_hidden_states_image"] = torch.randn(batch, 16, config["image_dim"], generator=generator)
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


# Wan's published numbers, which the models built like it share
WAN = dict(attention_head_dim=128, cross_attn_norm=True, eps=1e-06, freq_dim=256, out_channels=16,
           patch_size=(1, 2, 2), qk_norm="rms_norm_across_heads", text_dim=4096)
WAN_TINY = dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
                freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32)


# --- JoyImage-Edit and Edit-Plus: two diffusers files, one attention layout ------------------------------------------

# Each stream's fused `*_attn_qkv` as q/k/v rows (`qkv_rows`), heads split across ranks; per-head QK-norms; one
# all-reduce per stream's output projection.
JOYIMAGE_ATTENTION_TP_PLAN = {
    "img_attn_qkv.q": ColwiseParallel(),
    "img_attn_qkv.k": ColwiseParallel(),
    "img_attn_qkv.v": ColwiseParallel(),
    "img_attn_q_norm": HEAD_NORM,
    "img_attn_k_norm": HEAD_NORM,
    "img_attn_proj": RowwiseParallel(),
    "txt_attn_qkv.q": ColwiseParallel(),
    "txt_attn_qkv.k": ColwiseParallel(),
    "txt_attn_qkv.v": ColwiseParallel(),
    "txt_attn_q_norm": HEAD_NORM,
    "txt_attn_k_norm": HEAD_NORM,
    "txt_attn_proj": RowwiseParallel(),
}


# diffusers scripts/convert_joyimage_edit_to_diffusers.py, TRANSFORMER_CONFIG (JoyImage-Edit and Edit-Plus alike)
_JOYIMAGE = dict(hidden_size=4096, in_channels=16, num_attention_heads=32, num_layers=40, out_channels=16,
                 patch_size=[1, 2, 2], rope_dim_list=[16, 56, 56], text_dim=4096, rope_type="rope", theta=10000)
# diffusers' JoyImageEdit(Plus)TransformerTesterConfig, 4 heads (theirs: 2) so that a mesh of 4 splits them
_JOYIMAGE_TINY = dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=64, num_attention_heads=4, text_dim=16,
                      num_layers=2, rope_dim_list=[4, 6, 6], theta=256)


def joyimage_family(name: str, model: type[nn.Module], attention: type[nn.Module], processor: type, variant: str,
                    example_inputs: Callable[..., dict]) -> Family:
    """A JoyImage family: both streams' fused q/k/v as rows, and the processor's head-dim twin. The processor chunks
    each fused output in three (each rank's q/k/v share, in order) and unflattens by a local `heads = attn.heads`,
    which the processor rule does not read: the twin's edit, listed here, unflattens by `attn.head_dim` instead. The
    blocks' feed-forwards are diffusers' `FeedForward`; the modulation is a parameter table, no Linear."""
    register_edits(processor, "__call__", (("(heads, -1)", "(-1, attn.head_dim)", 6),))
    width = lambda m: m.heads * m.head_dim  # noqa: E731 - each of Q, K, V
    rewrite = swap_rewrite(f"{name}.attention", attention, processors=Processors((processor,)),
                           leaves=(qkv_rows("img_attn_qkv", width), qkv_rows("txt_attn_qkv", width)))
    return derived_family(
        name, model, rewrites=(rewrite,),
        variants={variant: dict(_JOYIMAGE)}, default_variant=variant,
        sources="diffusers scripts/convert_joyimage_edit_to_diffusers.py (TRANSFORMER_CONFIG: 40 double blocks, "
        "hidden 4096 = 32 heads of 128, text 4096, rope axes (16, 56, 56), theta 10000)",
        example_inputs=example_inputs,
        tp=TensorParallel(plans={attention: JOYIMAGE_ATTENTION_TP_PLAN}),
        tests=Tests(configs={"tiny": dict(_JOYIMAGE_TINY)}),
    )


def cast_inputs(inputs: dict, dtype: torch.dtype, device) -> dict:
    """`inputs` on `device`, their floating tensors in `dtype` (anything else as it is)."""
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) if isinstance(v, torch.Tensor)
            else v for k, v in inputs.items()}


def sana_conditions(config: dict, batch: int, text_tokens: int, generator: torch.Generator) -> dict:
    """Caption features with their mask (the last two tokens padding: the cross attention's mask path runs), a
    timestep, and for a guidance-distilled config (Sana-Sprint) the guidance scale."""
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[:, -2:] = 0
    inputs = dict(
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("caption_channels", 2304),
                                          generator=generator),
        encoder_attention_mask=mask,
        timestep=torch.rand(batch, generator=generator) * 1000,
    )
    if config.get("guidance_embeds"):
        inputs["guidance"] = torch.rand(batch, generator=generator) * 5
    return inputs


CONV_FEED_FORWARD = ("a Conv2d feed-forward (1x1 up, depthwise 3x3, GLU, 1x1 down): stock Colwise/RowwiseParallel "
                     "shard Linears only and DTensor's convolution shards no channels of a full convolution (the "
                     "depthwise rule, DepthwiseChannels, covers one filter per channel only), so every rank holds it "
                     "whole")


def text_with_mask(generator: torch.Generator, batch: int, tokens: int,
                   width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Text embeddings and their boolean mask (the pipelines' tokenizer mask), the last two tokens of the second sample
    padding (the mask path runs)."""
    mask = torch.ones(batch, tokens, dtype=torch.bool)
    if batch > 1 and tokens > 2:
        mask[1, -2:] = False
    return torch.randn(batch, tokens, width, generator=generator), mask


LTX2 = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
            attention_head_dim=128, cross_attention_dim=4096, vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20,
            base_height=2048, base_width=2048, audio_in_channels=128, audio_out_channels=128, audio_patch_size=1,
            audio_patch_size_t=1, audio_num_attention_heads=32, audio_attention_head_dim=64,
            audio_cross_attention_dim=2048, audio_scale_factor=4, audio_pos_embed_max_pos=20,
            audio_sampling_rate=16000, audio_hop_length=160, num_layers=48, activation_fn="gelu-approximate",
            qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=3840,
            attention_bias=True, attention_out_bias=True, rope_theta=10000.0, rope_double_precision=True,
            causal_offset=1, timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000,
            rope_type="split")


# audio_cross_attention_dim is the audio attention's width (a2v keys, the cross-modal rotary tables); 4 heads each,
# so the tiny models split at world 2 and 4
LTX2_TINY = dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
                 audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=4, audio_attention_head_dim=8,
                 audio_cross_attention_dim=32, num_layers=2, caption_channels=16, rope_type="split")


# The configs the suite shards in fp32: one block, heads of 16, no attention biases. The seeded biases (about 1 each)
# dominate q and k, whose norm across heads then cancels most of them, and heads of 4 or 8 average little: the q/k
# gradients moved by up to 1.1e-5 under a mere change of summation order (measured at world 2); so configured, at
# most 3.3e-6 over the seeds tried. The biased two-block configs shard in float64 (tests/families/test_ltx.py).
LTX2_WIDE = dict(attention_head_dim=16, cross_attention_dim=64, audio_attention_head_dim=16,
                 audio_cross_attention_dim=64)


def cogvideox_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `CogVideoXTransformer3DModel.forward`: a latent video of `image_tokens` patches
    (frames of 2 x 2; a config with a learned positional embedding, which takes only its published grid, gets that
    grid), text of `text_embed_dim`, a timestep, and for a RoPE config (`use_rotary_positional_embeddings`) the 3D
    rotary cos/sin of its grid, as the pipeline computes them (one per token, head_dim wide)."""
    generator = torch.Generator().manual_seed(seed)
    p = config.get("patch_size", 2)
    if config.get("use_learned_positional_embeddings"):
        frames = (config.get("sample_frames", 49) - 1) // config.get("temporal_compression_ratio", 4) + 1
        rows, cols = config.get("sample_height", 60) // p, config.get("sample_width", 90) // p
    else:
        rows = cols = 2
        frames = max(1, image_tokens // (rows * cols))
    inputs = dict(
        hidden_states=torch.randn(batch, frames, config.get("in_channels", 16), rows * p, cols * p,
                                  generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("text_embed_dim", 4096), generator=generator),
        timestep=(torch.rand(batch, generator=generator) * 1000).long(),
    )
    inputs = cast_inputs(inputs, dtype, device)
    if config.get("use_rotary_positional_embeddings"):
        cos, sin = get_3d_rotary_pos_embed(config.get("attention_head_dim", 64), ((0, 0), (rows, cols)), (rows, cols),
                                           frames)
        inputs["image_rotary_emb"] = (cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype))
    return inputs


# diffusers' generic `Attention` lists no processors (each model sets its own); one rewrite of it for every family
# that passes these
GENERIC = (AttnProcessor2_0, JointAttnProcessor2_0, CogVideoXAttnProcessor2_0, HunyuanAttnProcessor2_0,
           LuminaAttnProcessor2_0)


GEGLU_ROWS = swap_rewrite("diffusers_common.geglu: hidden and gate rows", GEGLU, leaves=(
    rows("proj", lambda geglu: [("hidden", geglu.proj.out_features // 2), ("gate", geglu.proj.out_features // 2)]),))


def _unsplit(ff: nn.Module) -> bool:
    """A feed-forward whose `net.0.proj` is not split into rows (GEGLU's, derived instead). Told by the split, not by
    `nn.Linear`: PEFT's LoRA layer wrapping a plain `proj` is no `nn.Linear`, and its feed-forward keeps this plan."""
    return not isinstance(getattr(ff.net[0], "proj", None), SplitLeaf)


FAMILY = Family(
    name="diffusers-common",
    model_class=None,
    rewrites=(GEGLU_ROWS,),
    tp=TensorParallel(plans={FeedForward: FEED_FORWARD_TP_PLAN}, checks={FeedForward: _check_feed_forward},
                      when={FeedForward: _unsplit}),
)


# --- diffusers' fuse_qkv_projections(), undone ------------------------------------------------------------------------

# the Linears diffusers' `AttentionModuleMixin.fuse_projections` concatenates, by the name of the one it adds
QKV_FUSIONS = {"to_qkv": ("to_q", "to_k", "to_v"), "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}


class SplitQKV:
    """An attention whose `fuse_qkv_projections()` fusion `surgery.unfuse` split back into to_q/to_k/to_v (and
    add_*_proj), mixed into the stock class it runs exactly as (`class FluxSplitQKVAttention(SplitQKV, FluxAttention)`).
    The class only records that `surgery.fuse` restores `to_qkv` / `to_added_qkv`. diffusers' `fuse_qkv_projections()`
    is then a no-op (the projections count as fused already) and `unfuse_qkv_projections()` makes it the stock class,
    which `fuse` leaves alone: the same end state as on the stock model."""

    def fuse_projections(self) -> None:
        return None

    def unfuse_projections(self) -> None:
        self.__class__ = _stock_attention(type(self))  # the same module, its fusion forgotten
        self.fused_projections = False


def _stock_attention(cls: type) -> type:
    return next(c for c in cls.__mro__ if not issubclass(c, SplitQKV))


def qkv_fused(m: nn.Module) -> bool:
    """Whether diffusers' `fuse_qkv_projections()` fused `m` (it keeps the q/k/v Linears beside the fused ones)."""
    return bool(getattr(m, "fused_projections", False))


def _qkv_fusions(m: nn.Module) -> list[tuple[str, list[nn.Linear]]]:
    """(fused name, its q/k/v Linears) for each fusion `fuse_projections` makes of `m`: stock fusing keeps the q/k/v
    Linears beside the fused one, so both forms hold them."""
    return [(fused, [getattr(m, p) for p in parts]) for fused, parts in QKV_FUSIONS.items()
            if all(isinstance(getattr(m, p, None), nn.Linear) for p in parts)]


def _qkv_slices(m: nn.Module) -> list:
    slices = []
    for fused, linears in _qkv_fusions(m):
        parts = [(name, linear.out_features) for name, linear in zip(QKV_FUSIONS[fused], linears)]
        slices += row_slices(fused, parts, "weight")
        if linears[0].bias is not None:
            slices += row_slices(fused, parts, "bias")
    return slices


def fused_qkv_rewrite(name: str, fused: type[nn.Module], unfused: type[nn.Module], *, processors=None,
                      check=None) -> Rewrite:
    """The rewrite that undoes diffusers' `fuse_qkv_projections()` on attentions of class `fused`: `to_qkv`
    (`to_added_qkv`) back into to_q/to_k/to_v (add_*_proj) in an `unfused` (`SplitQKV` mixed into `fused`);
    `surgery.fuse` restores the stock fused form. `processors(processor, unfusing)`: the processor each form runs
    where the family rewrites it too (FLUX.3's head-dim twin)."""

    def swap(m: nn.Module, cls: type[nn.Module], unfusing: bool) -> nn.Module:
        fusions = _qkv_fusions(m)
        with torch.device("meta"):  # the slices fill them
            if unfusing:
                new = recast(m, cls, **{p: nn.Linear(linear.in_features, linear.out_features,
                                                     bias=linear.bias is not None)
                                        for fused_name, linears in fusions
                                        for p, linear in zip(QKV_FUSIONS[fused_name], linears)})
                for fused_name, _ in fusions:
                    del new._modules[fused_name]
            else:
                new = recast(m, cls)
                for fused_name, linears in fusions:
                    setattr(new, fused_name, nn.Linear(linears[0].in_features, sum(l.out_features for l in linears),
                                                       bias=linears[0].bias is not None))
        new.fused_projections = not unfusing
        if processors is not None:
            new.set_processor(processors(m.processor, unfusing=unfusing))
        return new

    return Rewrite(
        name=name,
        fused=fused,
        unfused=unfused,
        slices=_qkv_slices,
        build_unfused=lambda m: swap(m, unfused, unfusing=True),
        build_fused=lambda m: swap(m, fused, unfusing=False),
        is_fused=qkv_fused,
        in_checkpoints=False,
        **({} if check is None else {"check": check}),
    )
