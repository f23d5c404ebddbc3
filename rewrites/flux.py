"""FLUX.1 (diffusers `FluxTransformer2DModel`: FLUX.1-dev, -schnell, -Kontext, -Fill, -Depth): what is fused, its
unfused form, the slices between them, and stock tensor-parallel plans.

| module (diffusers class, kept)        | fused Linear               | unfused                                   |
|---------------------------------------|----------------------------|-------------------------------------------|
| `FluxSingleTransformerBlock`          | `proj_out` (reads          | `SplitProjection`: cols -> `.attn_part`   |
|                                       | `cat([attn, mlp], dim=2)`) | (bias), `.mlp_part`                       |
| `FluxAttention` after                 | `to_qkv`, `to_added_qkv`   | `FluxSplitQKVAttention`: to_q, to_k,      |
| `fuse_qkv_projections()`              |                            | to_v; add_q/k/v_proj                      |

The single block keeps its class and diffusers' forward: `proj_out` is swapped for a leaf that takes the same
concatenation (`surgery.core.leaves`). Everything else is already unfused in diffusers. Its stock `FluxAttnProcessor`
splits heads with `unflatten(-1, (-1, attn.head_dim))`, so it runs column-sharded as is (the IP-adapter processor
splits by `attn.heads` and is refused by the tensor-parallel check).

The single-block rewrite here (`flux1_single_block_rewrite`) serves every DiT whose single-stream block is FLUX.1's
with other norms or call arguments (Chroma imports it); its plan is the shared `SINGLE_BLOCK_TP_PLAN`
(`rewrites/diffusers_common.py`), as is the double-stream attention's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxIPAdapterAttnProcessor,
    FluxSingleTransformerBlock,
    FluxTransformer2DModel,
)

from surgery_rewrites.diffusers_common import (
    DOUBLE_STREAM_ATTENTION_TP_PLAN,
    QKV_FUSIONS,
    SINGLE_BLOCK_TP_PLAN,
    SplitQKV,
    fused_qkv_rewrite,
    qkv_fused,
)
from surgery.core.checks import check_hooks, check_linear, mesh_sizes_dividing
from surgery.core.errors import SurgeryError
from surgery.core.rewrite import fuse, unfuse
from surgery.extend import Family, Rewrite, TensorParallel, Tests, columns, swap_rewrite

# --- the single-stream block ---------------------------------------------------------------------------------------

# the fused proj_out reads cat([attention output, MLP hidden]): its first columns are the attention's
PROJ_OUT = columns("proj_out", lambda m: m.proj_out.in_features - m.mlp_hidden_dim)


def _nested_qkv(attn: nn.Module, unfusing: bool) -> bool:
    """Whether a block's attention is in the form its own (QKV) rewrite converts in this direction."""
    if unfusing:
        return type(attn) is FluxAttention and qkv_fused(attn)
    return type(attn) is FluxSplitQKVAttention


def _other_attention(attn: nn.Module, unfusing: bool) -> nn.Module:
    """The block's attention in the block's new form: shared as is, or — when `fuse_qkv_projections()` fused it —
    converted by its own rewrite (a new module: the engine does not visit modules nested in one it rewrites)."""
    if not _nested_qkv(attn, unfusing):
        return attn
    return unfuse(attn) if unfusing else fuse(attn)


def flux1_single_block_rewrite(name: str, cls: type[nn.Module]) -> Rewrite:
    """The rewrite of a FLUX.1-style single-stream block class: `proj_out` swapped for a `SplitProjection`, the
    block's class and forward kept; its attention, where `fuse_qkv_projections()` fused it, converted along."""

    def check(m: nn.Module, path: str, verb: str) -> None:
        """What the nested attention's conversion relies on, checked with the rest before anything is swapped."""
        unfusing = verb == "unfuse"
        if not _nested_qkv(m.attn, unfusing):
            return
        check_hooks(m.attn, f"{path}.attn", verb)
        for name, linear in _qkv_linears(m.attn, fused_form=unfusing):
            check_linear(linear, f"{path}.attn.{name}", verb)
            check_hooks(linear, f"{path}.attn.{name}", verb)

    return swap_rewrite(name, cls, leaves=(PROJ_OUT,), children={"attn": _other_attention}, check=check)


# --- fuse_qkv_projections() --------------------------------------------------------------------------------------


class FluxSplitQKVAttention(SplitQKV, FluxAttention):
    """A `FluxAttention` whose `fuse_qkv_projections()` fusion was split back (`SplitQKV`)."""


def _qkv_linears(m: nn.Module, fused_form: bool) -> list[tuple[str, nn.Module]]:
    names = list(QKV_FUSIONS) if fused_form else [part for parts in QKV_FUSIONS.values() for part in parts]
    return [(n, getattr(m, n)) for n in names if isinstance(getattr(m, n, None), nn.Linear)]


def check_single_block(module: nn.Module, path: str, world: int) -> None:
    """Whole heads per rank (the block has no `heads` of its own for the generic check), and a shardable processor."""
    heads = module.attn.heads
    if heads % world:
        raise SurgeryError(
            f"surgery.tensor_parallel: '{path}.attn' has {heads} attention heads, which a mesh of {world} cannot "
            f"split evenly. Use a mesh size that divides {heads}: {mesh_sizes_dividing(heads)}."
        )
    check_attention_processor(module, path, world)


def check_attention_processor(module: nn.Module, path: str, world: int) -> None:
    """`FluxIPAdapterAttnProcessor` reshapes by `attn.heads` (the global count), so it cannot run column-sharded."""
    for name, m in [("", module), *module.named_modules()]:
        processor = getattr(m, "processor", None)
        if isinstance(processor, FluxIPAdapterAttnProcessor):
            where = ".".join(p for p in (path, name) if p)
            raise SurgeryError(
                f"surgery.tensor_parallel: '{where}' uses FluxIPAdapterAttnProcessor, which splits heads by the "
                f"global attn.heads and cannot run on a rank's {world}th of the heads. Unload the IP-Adapter "
                "(pipe.unload_ip_adapter()) before sharding."
            )


REWRITES = (
    flux1_single_block_rewrite("flux1.single_block", FluxSingleTransformerBlock),
    fused_qkv_rewrite("flux1.fused_qkv_attention", FluxAttention, FluxSplitQKVAttention),
)

# The double-stream attention (stock, already unfused): heads split across ranks, one all-reduce per output
# projection. Keyed by `FluxAttention`, which Chroma shares: registered here only. The single-stream block: one
# all-reduce per block (both halves of the unfused proj_out leave partial sums).
TP_PLANS = {
    FluxAttention: DOUBLE_STREAM_ATTENTION_TP_PLAN,
    FluxSplitQKVAttention: DOUBLE_STREAM_ATTENTION_TP_PLAN,
    FluxSingleTransformerBlock: SINGLE_BLOCK_TP_PLAN,
}
TP_CHECKS = {
    FluxAttention: check_attention_processor,
    FluxSplitQKVAttention: check_attention_processor,
    FluxSingleTransformerBlock: check_single_block,
}


# --- the family: published configs, example inputs, test configs ----------------------------------------------------

# The published transformer/config.json files of black-forest-labs/FLUX.1-dev, -schnell, -Kontext-dev, -Fill-dev and
# -Depth-dev (the same numbers as diffusers' scripts/convert_flux_to_diffusers.py): 19 double / 38 single blocks,
# 24 heads x 128, T5 width 4096, CLIP pooled 768, rope axes (16, 56, 56); all but schnell are guidance-distilled
# (diffusers' single-file loader tells them apart by `guidance_in` and by img_in's width: 384 for Fill — latents,
# masked image, mask — and 128 for Depth; both write 64 channels).
_FLUX1 = dict(
    num_layers=19, num_single_layers=38, num_attention_heads=24, attention_head_dim=128,
    joint_attention_dim=4096, pooled_projection_dim=768, in_channels=64, axes_dims_rope=(16, 56, 56),
)
VARIANTS = {
    "dev": dict(_FLUX1, guidance_embeds=True),
    "schnell": dict(_FLUX1, guidance_embeds=False),
    "kontext-dev": dict(_FLUX1, guidance_embeds=True),
    "fill-dev": dict(_FLUX1, guidance_embeds=True, in_channels=384, out_channels=64),
    "depth-dev": dict(_FLUX1, guidance_embeds=True, in_channels=128, out_channels=64),
}


def rope_axes_like_flux1(head_dim: int) -> tuple[int, int, int]:
    """Three even rotary axes summing to `head_dim`, shaped like FLUX.1's (16, 56, 56) for 128."""
    if head_dim % 4:
        raise SurgeryError(f"head_dim {head_dim} is not a multiple of 4 (three rotary axes of even size)")
    first = 2 * max(1, head_dim // 16)
    if (head_dim - first) % 4:
        first += 2
    return (first, (head_dim - first) // 2, (head_dim - first) // 2)


def example_inputs(
    config: dict,
    batch: int = 1,
    image_tokens: int = 16,
    text_tokens: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict:
    """Seeded keyword arguments for `FluxTransformer2DModel.forward` at `config` (a dict of its init arguments)."""
    generator = torch.Generator().manual_seed(seed)
    axes = len(config.get("axes_dims_rope", (16, 56, 56)))
    inputs = dict(
        hidden_states=torch.randn(batch, image_tokens, config.get("in_channels", 64), generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("joint_attention_dim", 4096),
                                          generator=generator),
        pooled_projections=torch.randn(batch, config.get("pooled_projection_dim", 768), generator=generator),
        timestep=torch.rand(batch, generator=generator),
        # integer positions (FluxPosEmbed takes ids.float()): no gradient flows into them
        img_ids=torch.randint(0, 64, (image_tokens, axes), generator=generator),
        txt_ids=torch.zeros(text_tokens, axes, dtype=torch.long),
        guidance=torch.full((batch,), 3.5) if config.get("guidance_embeds", False) else None,
    )
    floating = {"hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"}
    return {
        k: None if v is None else v.to(device=device, dtype=dtype if k in floating else v.dtype)
        for k, v in inputs.items()
    }


def reduced(config: dict, layers: int = 2, single_layers: int = 4, head_dim: int = 32) -> dict:
    """A published config at demo size: same head count and widths' ratios; fewer blocks, smaller heads."""
    return dict(config, num_layers=layers, num_single_layers=single_layers, attention_head_dim=head_dim,
                axes_dims_rope=rope_axes_like_flux1(head_dim))


def small(**config) -> dict:
    rope = rope_axes_like_flux1(config["attention_head_dim"])
    return dict(config, in_channels=16, pooled_projection_dim=16, axes_dims_rope=rope)


# Small-width configs shaped like the real ones, plus awkward shapes. The first one is what the conformance suite
# shards (world 2 and 4): 4 heads x 8 and int(32 * 4) = 128 MLP units split evenly over 2 and 4 ranks.
TEST_CONFIGS = {
    "tp_dev": small(num_layers=1, num_single_layers=2, num_attention_heads=4, attention_head_dim=8,
                    joint_attention_dim=24, guidance_embeds=True),
    # schnell: 19 double / 38 single, 24 heads -> 1 / 2, 3 heads; no guidance
    "schnell_small": small(num_layers=1, num_single_layers=2, num_attention_heads=3, attention_head_dim=12,
                           joint_attention_dim=16, guidance_embeds=False),
    # fill: more input channels than output
    "fill_odd_heads": dict(small(num_layers=1, num_single_layers=2, num_attention_heads=5, attention_head_dim=8,
                                 joint_attention_dim=8, guidance_embeds=True), in_channels=40, out_channels=16),
}

FAMILY = Family(
    name="flux1",
    model_class=FluxTransformer2DModel,
    variants=VARIANTS,
    sources="black-forest-labs/FLUX.1-dev, -schnell, -Kontext-dev, -Fill-dev, -Depth-dev transformer/config.json; "
    "diffusers scripts/convert_flux_to_diffusers.py and loaders/single_file_utils.py (in_channels of Fill / Depth)",
    default_variant="dev",
    example_inputs=example_inputs,
    rewrites=REWRITES,
    shrink_config=reduced,
    tp=TensorParallel(
        plans=TP_PLANS,
        checks=TP_CHECKS,
        # per double block: to_out + to_add_out + ff + ff_context; per single block: one (partial sums resolved once).
        # diffusers' packed plan: the same (PackedRowwiseParallel all-reduces proj_out once).
        all_reduces=lambda config: 4 * config.get("num_layers", 19) + config.get("num_single_layers", 38),
    ),
    tests=Tests(configs=TEST_CONFIGS),
)
