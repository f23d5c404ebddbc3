"""QwenImage (diffusers `QwenImageTransformer2DModel`): nothing fused, so no rewrite; stock tensor-parallel plans only.

Every double-stream block already holds separate q/k/v (image and text), separate output projections and two plain
GELU `FeedForward`s (planned once, in `rewrites/diffusers_common.py`). Its processor,
`QwenDoubleStreamAttnProcessor2_0`, splits heads by `head_dim` (`unflatten(-1, (-1, head_dim))`), so it runs
unchanged on each rank's share of the heads. The plan below is diffusers' own `_tp_plan` for this class, plus the
QK-norms as per-head norms (replicated weights whose gradients are summed over ranks); same collectives: four
all-reduces per block.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    QwenImageTransformer2DModel,
    QwenImageTransformerBlock,
)

from surgery_rewrites.diffusers_common import DOUBLE_STREAM_ATTENTION_TP_PLAN
from surgery.core.errors import SurgeryError
from surgery.core.leaves import runs_twin
from surgery.extend import Family, TensorParallel, Tests
from surgery.parallel.derive import processor_writes_in_place, qk_norms_per_head

# diffusers' generic `Attention` as QwenImage's double-stream block builds it takes the shared double-stream plan
# (rewrites/diffusers_common.py): heads split across ranks, one all-reduce per output projection (image and text).
# Only the keys a module has apply.

# Processors of `Attention` that split heads by head_dim, so a rank's column shard of q/k/v is whole heads: QwenImage's,
# and the head-dim twins `unfuse` installs (HunyuanImage's and HunyuanVideo's blocks, see `surgery.core.leaves`): this one
# plan serves every `Attention` that can be sharded. `Attention` is diffusers' shared class: an `Attention` running any
# other processor (most reshape with `attn.heads`) is not planned and stays whole on every rank.
HEAD_DIM_PROCESSORS = (QwenDoubleStreamAttnProcessor2_0,)


def _splits_by_head_dim(module: nn.Module) -> bool:
    # a twin that writes into a slice of q/k in place (CogView4's rotary) takes the derived plan, whose projections
    # hand the processor tensors of their own (surgery.parallel.derive.OwnedColwise); so does one whose q/k norms
    # span every head (Sana-Sprint's, Sana-Video's `rms_norm_across_heads`: their statistic, `AcrossHeadsNorm`)
    return type(getattr(module, "processor", None)) in HEAD_DIM_PROCESSORS or (
        runs_twin(module) and not processor_writes_in_place(module.processor) and qk_norms_per_head(module))


# Qwen/Qwen-Image transformer/config.json (Qwen-Image-Edit and Edit-2509 share it); Edit-2511 adds zero_cond_t.
_BASE = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)
VARIANTS = {
    "qwen-image": dict(_BASE),
    "edit": dict(_BASE),
    "edit-2511": dict(_BASE, zero_cond_t=True),
}


def _grid(tokens: int) -> tuple[int, int]:
    """(height, width) in latent patches with height * width == tokens, as square as possible."""
    height = max(d for d in range(1, math.isqrt(tokens) + 1) if tokens % d == 0)
    return height, tokens // height


def example_inputs(
    config: dict,
    batch: int = 1,
    image_tokens: int = 16,
    text_tokens: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict:
    """Seeded keyword arguments for `QwenImageTransformer2DModel.forward`: one image of `image_tokens` patches (with
    `zero_cond_t`, an edit: a target and a condition image of half as many each), text of `text_tokens` with the
    last token of every sample but the first masked as padding."""
    generator = torch.Generator().manual_seed(seed)
    in_channels = config.get("in_channels", 64)
    if config.get("zero_cond_t", False):
        height, width = _grid(image_tokens // 2)
        shapes = [(1, height, width), (1, height, width)]
    else:
        height, width = _grid(image_tokens)
        shapes = [(1, height, width)]
    mask = torch.ones(batch, text_tokens, dtype=torch.bool)
    mask[1:, -1] = False
    inputs = dict(
        hidden_states=torch.randn(batch, image_tokens, in_channels, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("joint_attention_dim", 3584),
                                          generator=generator),
        encoder_hidden_states_mask=mask,
        timestep=torch.rand(batch, generator=generator),
    )
    floating = {"hidden_states", "encoder_hidden_states", "timestep"}
    inputs = {k: v.to(device=device, dtype=dtype if k in floating else v.dtype) for k, v in inputs.items()}
    return dict(inputs, img_shapes=[shapes] * batch)


def reduced(config: dict, layers: int = 2, single_layers: int | None = None, head_dim: int = 32) -> dict:
    """A published config at demo size: same head count and text width, fewer blocks, smaller heads.
    (QwenImage has no single-stream blocks: `single_layers` is accepted and ignored.)"""
    if head_dim % 8:
        raise SurgeryError(f"head_dim {head_dim} is not a multiple of 8 (3 rotary axes of even size)")
    quarter = head_dim // 4
    return dict(config, num_layers=layers, attention_head_dim=head_dim, axes_dims_rope=(quarter, quarter, 2 * quarter))


def _small(**config) -> dict:
    rope = {8: (2, 2, 4), 12: (4, 4, 4), 16: (4, 6, 6)}[config["attention_head_dim"]]
    return dict(dict(patch_size=2, in_channels=16, out_channels=4, guidance_embeds=False), axes_dims_rope=rope,
                **config)


# The first one is sharded at world 2 and 4 (4 heads, widths 32 and 128).
TEST_CONFIGS = {
    "tp_small": _small(num_layers=2, num_attention_heads=4, attention_head_dim=8, joint_attention_dim=16),
    # Edit-2511: per-token modulation (target vs condition image)
    "edit2511_small": _small(num_layers=1, num_attention_heads=2, attention_head_dim=12, joint_attention_dim=24,
                             zero_cond_t=True),
    "odd_heads": _small(num_layers=1, num_attention_heads=3, attention_head_dim=16, joint_attention_dim=8),
}

FAMILY = Family(
    name="qwen-image",
    model_class=QwenImageTransformer2DModel,
    variants=VARIANTS,
    sources="Qwen/Qwen-Image, Qwen/Qwen-Image-Edit transformer/config.json (QwenImageTransformer2DModel defaults "
    "match them); Qwen/Qwen-Image-Edit-2511: zero_cond_t=True",
    default_variant="qwen-image",
    example_inputs=example_inputs,
    shrink_config=reduced,
    tp=TensorParallel(
        plans={Attention: DOUBLE_STREAM_ATTENTION_TP_PLAN},
        when={Attention: _splits_by_head_dim},
        # as in diffusers' _tp_plan: each stream's modulation (SiLU, Linear) reads the replicated timestep embedding
        replicated={QwenImageTransformerBlock: dict.fromkeys(("img_mod.1", "txt_mod.1"), "adaLN modulation of the "
                                                             "replicated timestep embedding")},
        # per block: attention image out + text out + img_mlp + txt_mlp (as diffusers' _tp_plan)
        all_reduces=lambda config: 4 * config.get("num_layers", 60),
    ),
    tests=Tests(configs=TEST_CONFIGS),
)
