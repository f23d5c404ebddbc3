"""PRX (diffusers `transformer_prx.py`): single-stream blocks whose image tokens attend to text and image keys; the
attention holds the image q/k/v fused in one Linear (`img_qkv_proj`) and the text k/v in another (`txt_kv_proj`).

Unfused the drop-in way: the stock classes and forwards stay; each fused Linear becomes a `SplitRows` (rows -> `.q`,
`.k`, `.v` and `.k`, `.v`: views), and the processor runs its head-dim twin. The processor reads each fused output as
`reshape(B, L, 3, attn.heads, attn.head_dim)` (Q, K, V outermost, as the rows lie): on a rank, `SplitRows` returns its
heads' q, k and v in that order, so the twin's one edit per reshape, `3, -1, attn.head_dim` (and `2, ...`), reads
them. The block's gated MLP (`gate_proj`, `up_proj`, `down_proj`, its own Linears) is planned with the block: 2
all-reduces per block (attention output, MLP output); the modulation Linear reads the replicated conditioning.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_prx import (
    PRXAttention,
    PRXAttnProcessor2_0,
    PRXBlock,
    PRXTransformer2DModel,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery_rewrites.diffusers_common import cast_inputs, qkv_rows
from surgery.extend import Processors, TensorParallel, Tests, derived_family, register_edits, swap_rewrite
from surgery.parallel.derive import per_head_norm

register_edits(PRXAttnProcessor2_0, "__call__", (("3, attn.heads, attn.head_dim", "3, -1, attn.head_dim", 1),
                                                 ("2, attn.heads, attn.head_dim", "2, -1, attn.head_dim", 1)))

ATTENTION = swap_rewrite(
    "prx.attention", PRXAttention,
    leaves=(qkv_rows("img_qkv_proj", lambda m: m.inner_dim),
            qkv_rows("txt_kv_proj", lambda m: m.inner_dim, ("k", "v"))),
    processors=Processors((PRXAttnProcessor2_0,)),
)

# The processor normalizes q/k as [batch, heads, tokens, head_dim]: each rank's own heads, on dim 1.
HEAD_NORM = per_head_norm(1)

# Heads split across ranks, the MLP's hidden units too; one all-reduce each for the attention and the MLP output.
BLOCK_TP_PLAN = {
    "attention.img_qkv_proj.q": ColwiseParallel(),
    "attention.img_qkv_proj.k": ColwiseParallel(),
    "attention.img_qkv_proj.v": ColwiseParallel(),
    "attention.txt_kv_proj.k": ColwiseParallel(),
    "attention.txt_kv_proj.v": ColwiseParallel(),
    "attention.norm_q": HEAD_NORM,
    "attention.norm_k": HEAD_NORM,
    "attention.norm_added_k": HEAD_NORM,
    "attention.to_out.0": RowwiseParallel(),
    "gate_proj": ColwiseParallel(),
    "up_proj": ColwiseParallel(),
    "down_proj": RowwiseParallel(),
}


def prx_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `PRXTransformer2DModel.forward`, as diffusers' own model test builds them (a
    latent `(batch, channels, height, width)` of `image_tokens` patches, the text states, a timestep), with the text
    mask the pipeline passes, its last token padding."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config.get("patch_size", 2)
    mask = torch.ones(batch, text_tokens, dtype=torch.bool)
    mask[:, -1] = False
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 16), side, side, generator=generator),
        timestep=torch.rand(batch, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("context_in_dim", 2304), generator=generator),
        attention_mask=mask,
    )
    return cast_inputs(inputs, dtype, device)


# diffusers scripts/convert_prx_to_diffusers.py, its three variants (PRXFlux, PRXDCAE, PRXPixel)
_BASE = dict(context_in_dim=2304, hidden_size=1792, mlp_ratio=3.5, num_heads=28, depth=16, axes_dim=[32, 32],
             theta=10_000, time_factor=1000.0, time_max_period=10_000)
VARIANTS = {
    "flux": dict(_BASE, in_channels=16, patch_size=2),
    "dc-ae": dict(_BASE, in_channels=32, patch_size=1),
    "pixel": dict(_BASE, in_channels=3, patch_size=16, context_in_dim=2048, hidden_size=3584, depth=24,
                  axes_dim=[64, 64], bottleneck_size=768, resolution_embeds=True),
}

FAMILY = derived_family(
    "prx", PRXTransformer2DModel,
    rewrites=(ATTENTION,),
    variants=VARIANTS,
    sources="diffusers scripts/convert_prx_to_diffusers.py (PRXFlux: 16 blocks, 28 heads of 64, MLP ratio 3.5, "
    "T5Gemma text 2304, AutoencoderKL latents; PRXDCAE: the same on 32-channel DC-AE latents; PRXPixel (7B): 24 "
    "blocks, 28 heads of 128, pixel patches of 16 through a 768 bottleneck, Qwen3-VL text 2048)",
    default_variant="flux",
    example_inputs=prx_inputs,
    tp=TensorParallel(
        plans={PRXBlock: BLOCK_TP_PLAN},
        replicated={PRXBlock: {"modulation.lin": "adaptive-norm modulation of the replicated conditioning embedding"}},
    ),
    tests=Tests(
        # diffusers' PRXTransformerTesterConfig is the published width (28 heads of 64, 4 blocks): here 4 heads of 16
        # (worlds 2 and 4 split them), an MLP of int(64 * 3.5) = 224, two blocks, rotary axes (8, 8)
        configs={"tiny": dict(in_channels=16, patch_size=2, context_in_dim=24, hidden_size=64, mlp_ratio=3.5,
                              num_heads=4, depth=2, axes_dim=[8, 8], theta=10_000),
                 "pixel_tiny": dict(in_channels=3, patch_size=4, context_in_dim=24, hidden_size=64, mlp_ratio=3.5,
                                    num_heads=4, depth=1, axes_dim=[8, 8], bottleneck_size=16,
                                    resolution_embeds=True)},
    ),
)
