"""FLUX.3 (diffusers `Flux3Transformer2DModel`): the fused SwiGLU `linear_in` of every block's feed-forward, the
attention processor that reshapes by the stored head count, and `fuse_qkv_projections()`.

Built the drop-in way (`surgery.core.leaves`): every diffusers class and forward stays.

| module (diffusers class, kept)       | swapped                                                                  |
|--------------------------------------|--------------------------------------------------------------------------|
| `Flux3FeedForward` (`ff` of the mode | `linear_in` -> `SplitRows` (rows -> `.gate`, `.up`: views);              |
| blocks and the single blocks)        | `Flux3SwiGLU` halves whatever width it gets, so the stock forward runs   |
| `Flux3Attention`                     | processor `Flux3AttnProcessor` -> its head-dim twin (stock source, one   |
|                                      | listed edit: `unflatten(-1, (-1, attn.head_dim))`)                       |
| `Flux3Attention` after               | `Flux3SplitQKVAttention`: `to_qkv` rows -> to_q, to_k, to_v (views); the |
| `fuse_qkv_projections()`             | class only records that `fuse` restores `to_qkv` (no forward of its own) |

No tensor-parallel plan exists for FLUX.3 in diffusers 0.42.1 (no `_tp_plan`) or elsewhere; the plans below are stock
styles. Each block sums its attention and feed-forward outputs inside its own forward before gating them and adding
the residual (`hidden_states + mod_gate * (attn_output + ff_output)`), so one all-reduce of that sum suffices. A
mode block (called with positional tensors, also under gradient checkpointing) takes its tensor inputs as replicated
DTensors (`PrepareModuleInputOutput`), both output projections leave partial sums
(`RowwiseParallel(output_layouts=Partial())`), DTensor carries the sum through the gate and the residual, and the
block's output is resolved once: 1 all-reduce per mode block instead of 2. The joint single block is called with
keyword arguments in inference and positionally under gradient checkpointing, which no one stock input style covers,
and its output is two tensors (text and image tokens) that a block-level resolution would all-reduce separately: it
keeps one all-reduce per output projection, 2 per single block.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_flux3 import (
    Flux3Attention,
    Flux3AttnProcessor,
    Flux3FeedForward,
    Flux3ModeTransformerBlock,
    Flux3Transformer2DModel,
)
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel

from surgery_rewrites.diffusers_common import ATTENTION_TP_PLAN, SplitQKV, fused_qkv_rewrite
from surgery.core.errors import SurgeryError
from surgery.core.leaves import translate
from surgery.extend import Family, Processors, TensorParallel, Tests, rows, swap_rewrite
from surgery.parallel.styles import under

PROCESSORS = Processors((Flux3AttnProcessor,))


def _gate_up(ff: nn.Module) -> list[tuple[str, int]]:
    hidden = ff.linear_out.in_features
    return [("gate", hidden), ("up", hidden)]


class Flux3SplitQKVAttention(SplitQKV, Flux3Attention):
    """A `Flux3Attention` whose `fuse_qkv_projections()` fusion was split back (`SplitQKV`)."""


def _check_qkv(m: nn.Module, path: str, verb: str) -> None:
    if getattr(m, "use_bias", False):
        raise SurgeryError(f"surgery.{verb}: '{path}' has q/k/v biases, which Flux3Attention never builds.")


REWRITES = (
    swap_rewrite("flux3.feed_forward", Flux3FeedForward, leaves=(rows("linear_in", _gate_up),)),
    # fuse_qkv_projections(): before the processor rewrite, which would otherwise take the fused module
    fused_qkv_rewrite("flux3.fused_qkv_attention", Flux3Attention, Flux3SplitQKVAttention, processors=translate,
                      check=_check_qkv),
    swap_rewrite("flux3.attention", Flux3Attention, processors=PROCESSORS),
)

# gate and up split the hidden units across ranks; linear_out all-reduces once.
FEED_FORWARD_TP_PLAN = {
    "linear_in.gate": ColwiseParallel(),
    "linear_in.up": ColwiseParallel(),
    "linear_out": RowwiseParallel(),
}

PARTIAL = dict(output_layouts=Partial(), use_local_output=False)

# A mode block, whole: attention and feed-forward as above, but both output projections leave partial sums, which
# DTensor carries through `mod_gate * (attn + ff)` and the residual to the block's output, resolved there once.
# Inputs: (hidden_states, temb_mod, image_rotary_emb), positional; the rotary tables stay plain (the processor reads
# them beside the local q/k).
MODE_BLOCK_TP_PLAN = {
    **under("attn", {**ATTENTION_TP_PLAN, "to_out.0": RowwiseParallel(**PARTIAL)}),
    **under("ff", {**FEED_FORWARD_TP_PLAN, "linear_out": RowwiseParallel(**PARTIAL)}),
    "": PrepareModuleInputOutput(
        input_layouts=(Replicate(), Replicate(), None), desired_input_layouts=(Replicate(), Replicate(), None),
        use_local_input=False, output_layouts=Partial(), desired_output_layouts=Replicate(), use_local_output=True,
    ),
}

# The attention (in the single blocks): the shared plan, heads split across ranks; the output projection all-reduces.
TP_PLANS = {
    Flux3ModeTransformerBlock: MODE_BLOCK_TP_PLAN,
    Flux3Attention: ATTENTION_TP_PLAN,
    Flux3SplitQKVAttention: ATTENTION_TP_PLAN,
    Flux3FeedForward: FEED_FORWARD_TP_PLAN,
}
# A module with a stock (head-count) processor is refused as still fused before any of this applies; the plan needs
# the twin (or Flux3SplitQKVAttention, which carries it).
TP_WHEN = {Flux3Attention: lambda m: not getattr(m, "fused_projections", False)}


# --- the family: configs, example inputs, test configs ---------------------------------------------------------------

# No FLUX.3 checkpoint, config.json or conversion script is public as of diffusers 0.42.1 (its repository has no
# scripts/convert_flux3_to_diffusers.py): the one variant is the `Flux3Transformer2DModel` defaults, which its
# docstring describes as the released model (5 per-mode blocks for each of image, reference image and text; 28 joint
# single blocks; 24 heads of 128; stacked Qwen3-VL text states of width 20480; 4 rotary axes of 32), and the
# step-distilled flow-map form of it (`flow_map=True`: a second timestep embedder).
_DEFAULTS = dict(
    in_channels=128, cond_in_channels=128, num_layers=5, num_single_layers=28, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=20480, timestep_channels=256, mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
)
VARIANTS = {"flux3": dict(_DEFAULTS), "flow-map": dict(_DEFAULTS, flow_map=True)}


def example_inputs(
    config: dict,
    batch: int = 1,
    image_tokens: int = 16,
    text_tokens: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict:
    """Seeded keyword arguments for `Flux3Transformer2DModel.forward`, image-to-image: reference image tokens (half as
    many as the image's) pass through their own mode blocks, so every parameter takes part."""
    generator = torch.Generator().manual_seed(seed)
    axes = len(config.get("axes_dims_rope", (32, 32, 32, 32)))
    cond_tokens = max(1, image_tokens // 2)
    inputs = dict(
        hidden_states=torch.randn(batch, image_tokens, config.get("in_channels", 128), generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("joint_attention_dim", 20480),
                                          generator=generator),
        timestep=torch.rand(batch, generator=generator),
        img_ids=torch.randint(0, 64, (image_tokens, axes), generator=generator),
        txt_ids=torch.randint(0, 64, (text_tokens, axes), generator=generator),
        image_cond_hidden_states=torch.randn(batch, cond_tokens, config.get("cond_in_channels", 128),
                                             generator=generator),
        image_cond_ids=torch.randint(0, 64, (cond_tokens, axes), generator=generator),
        target_timestep=torch.rand(batch, generator=generator) if config.get("flow_map", False) else None,
    )
    floating = {"hidden_states", "encoder_hidden_states", "timestep", "target_timestep", "image_cond_hidden_states"}
    return {
        k: None if v is None else v.to(device=device, dtype=dtype if k in floating else v.dtype)
        for k, v in inputs.items()
    }


def reduced(config: dict, layers: int = 1, single_layers: int = 4, head_dim: int = 32) -> dict:
    """A published config at demo size: same head count, MLP ratio and text width; fewer blocks, smaller heads."""
    if head_dim % 8:
        raise SurgeryError(f"head_dim {head_dim} is not a multiple of 8 (4 rotary axes of even size)")
    return dict(config, num_layers=layers, num_single_layers=single_layers, attention_head_dim=head_dim,
                axes_dims_rope=(head_dim // 4,) * 4)


def _small(**config) -> dict:
    head_dim = config["attention_head_dim"]
    return dict(dict(in_channels=16, cond_in_channels=16, timestep_channels=32,
                     axes_dims_rope=(head_dim // 4,) * 4), **config)


# The first config is what the conformance suite shards (world 2 and 4): 8 heads and int(64 * 3) = 192 hidden units.
TEST_CONFIGS = {
    "tp_wide": _small(num_layers=1, num_single_layers=2, num_attention_heads=8, attention_head_dim=8,
                      joint_attention_dim=24),
    # the flow-map (step-distilled) form, odd heads, a fractional MLP ratio
    "flow_map_odd": _small(num_layers=1, num_single_layers=2, num_attention_heads=3, attention_head_dim=16,
                           joint_attention_dim=16, mlp_ratio=2.5, flow_map=True),
}

FAMILY = Family(
    name="flux3",
    model_class=Flux3Transformer2DModel,
    variants=VARIANTS,
    sources="diffusers 0.42.1 Flux3Transformer2DModel defaults and docstring (no public config.json or conversion "
    "script)",
    default_variant="flux3",
    example_inputs=example_inputs,
    rewrites=REWRITES,
    shrink_config=reduced,
    tp=TensorParallel(
        plans=TP_PLANS,
        when=TP_WHEN,
        # 1 per mode block (text-, image- and reference-image-mode blocks, as example_inputs passes reference
        # tokens), 2 per joint single block (attention out, feed-forward out). Without reference tokens:
        # 2 * num_layers + 2 * single.
        all_reduces=lambda config: 3 * config.get("num_layers", 5) + 2 * config.get("num_single_layers", 28),
    ),
    tests=Tests(configs=TEST_CONFIGS),
)
