"""HunyuanImage-2.1 (diffusers `HunyuanImageTransformer2DModel`): the single-stream block's fused output projection,
and attention that splits heads by head size so that it runs column-sharded.

| module (diffusers class, kept)               | swapped                                                     |
|----------------------------------------------|-------------------------------------------------------------|
| `HunyuanImageSingleTransformerBlock`         | `proj_out` -> `SplitProjection` (`.attn_part`, `.mlp_part`); |
|                                              | its `attn`'s processor                                      |
| `Attention` with `HunyuanImageAttnProcessor` | processor -> its head-dim twin (`surgery.core.leaves`)           |

diffusers' `HunyuanImageAttnProcessor` reshapes with the stored head count (`unflatten(2, (attn.heads, -1))`), which is
wrong on a rank that holds `heads / N` of them; its twin is the stock source with `unflatten(2, (-1, attn.inner_dim // attn.heads))`.
The token refiner's `Attention` runs diffusers' generic `AttnProcessor2_0`, whose head-dim twin (the processor rule,
installed by the generic `Attention` rewrite of the families whose processors are `diffusers_common.GENERIC`) shards it like any derived attention; its
feed-forward is sharded by the shared `FeedForward` plan.
"""

from __future__ import annotations

import math

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_hunyuanimage import (
    HunyuanImageAttnProcessor,
    HunyuanImageSingleTransformerBlock,
    HunyuanImageTransformer2DModel,
)

from surgery_rewrites.diffusers_common import SINGLE_BLOCK_TP_PLAN
from surgery.core.errors import SurgeryError
from surgery.extend import Family, Processors, TensorParallel, Tests, columns, swap_rewrite

PROCESSORS = Processors((HunyuanImageAttnProcessor,))
REWRITES = (
    swap_rewrite("hunyuan_image.single_block", HunyuanImageSingleTransformerBlock,
                 leaves=(columns("proj_out", lambda block: block.attn.inner_dim),), children={"attn": PROCESSORS}),
    # the double blocks' attention: diffusers' generic class, HunyuanImage's own told apart by their processor
    swap_rewrite("hunyuan_image.attention", Attention, processors=PROCESSORS),
)


# --- tensor-parallel plans ------------------------------------------------------------------------------------------

# The double-stream blocks' attention is diffusers' generic `Attention`, planned once in rewrites/qwenimage.py (for
# every `Attention` running a head-dim twin processor).

# The single-stream block: FLUX.1's shared plan (rewrites/diffusers_common.py): heads and MLP hidden units split
# across ranks; both halves of proj_out leave partial sums that one all-reduce resolves.
TP_PLANS = {HunyuanImageSingleTransformerBlock: SINGLE_BLOCK_TP_PLAN}


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
    shrink_config=reduced,
    tp=TensorParallel(
        plans=TP_PLANS,
        # per double block: attention out + added out + ff + ff_context; per single block: one; per token-refiner block:
        # its attention out and its feed-forward
        all_reduces=lambda config: 4 * config["num_layers"] + config["num_single_layers"]
        + 2 * config.get("num_refiner_layers", 2),
    ),
    tests=Tests(configs=TEST_CONFIGS),
)
