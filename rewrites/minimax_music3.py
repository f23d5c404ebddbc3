"""`MiniMaxMusic3Transformer1DModel` (diffusers `transformer_minimax_music3.py`): the `minimax-music3` family, the
flow-matching DiT of MiniMax Music 3 over 1-D audio latents (the timestep prepended as one token).

Its block holds its feed-forward as two Linears of its own: `ff_in` fuses the value and gate rows
(`ff_in(x).chunk(2)`, `value * silu(gate)`), `ff_out` reads their width back. Unfused the drop-in way: `ff_in`
becomes a `rows` leaf (value, gate: views) behind the same call, colwise, `ff_out` rowwise. The processor reshapes by
the stored head count (`view(batch, seq, attn.heads, attn.head_dim)`): its head-dim twin reads `-1` heads
(`register_edits`, drift-tested). The block's plan names the attention's projections too (a block plan covers the
block): 2 all-reduces per block (attention output, feed-forward output).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_minimax_music3 import (
    MiniMaxMusic3AttnProcessor,
    MiniMaxMusic3Transformer1DModel,
    MiniMaxMusic3TransformerBlock,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery.extend import Processors, TensorParallel, Tests, derived_family, register_edits, rows, swap_rewrite
from surgery_rewrites.diffusers_common import cast_inputs

register_edits(MiniMaxMusic3AttnProcessor, "__call__",
               (("seq_len, attn.heads, attn.head_dim", "seq_len, -1, attn.head_dim", 3),))

# value rows first, then the gate's (`chunk(2)`: the value is multiplied by silu(gate))
FEED_FORWARD = rows("ff_in", lambda block: [("value", block.ff_out.in_features), ("gate", block.ff_out.in_features)])
BLOCK = swap_rewrite("minimax_music3.block", MiniMaxMusic3TransformerBlock, leaves=(FEED_FORWARD,),
                     children={"attn": Processors((MiniMaxMusic3AttnProcessor,))})

BLOCK_TP_PLAN = {
    "attn.to_q": ColwiseParallel(),
    "attn.to_k": ColwiseParallel(),
    "attn.to_v": ColwiseParallel(),
    "attn.to_out.0": RowwiseParallel(),
    "ff_in.value": ColwiseParallel(),
    "ff_in.gate": ColwiseParallel(),
    "ff_out": RowwiseParallel(),
}


def minimax_music3_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                          dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `MiniMaxMusic3Transformer1DModel.forward`, as diffusers' own model test builds
    them: a latent of `image_tokens` frames, the frame-aligned conditioning, a flow-matching time in [0, 1]."""
    generator = torch.Generator().manual_seed(seed)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 128), image_tokens, generator=generator),
        encoder_hidden_states=torch.randn(batch, image_tokens, config.get("condition_dim", 2048), generator=generator),
        timestep=torch.rand(batch, generator=generator),
    )
    return cast_inputs(inputs, dtype, device)


FAMILY = derived_family(
    "minimax-music3", MiniMaxMusic3Transformer1DModel,
    rewrites=(BLOCK,),
    variants={"music3": dict(in_channels=128, condition_dim=2048, num_layers=36, num_attention_heads=32,
                             attention_head_dim=64, ff_inner_dim=8192, rotary_dim=32, fourier_embedding_dim=256)},
    sources="diffusers scripts/convert_minimax_music3_to_diffusers.py builds MiniMaxMusic3Transformer1DModel from its "
    "defaults with num_layers counted in the checkpoint (the defaults: 36 layers, 32 heads of 64, ff 8192, 128 latent "
    "channels, 2048 condition width); the checkpoint's layer count and config.json unverified here",
    default_variant="music3",
    example_inputs=minimax_music3_inputs,
    tp=TensorParallel(plans={MiniMaxMusic3TransformerBlock: BLOCK_TP_PLAN}),
    # diffusers' MiniMaxMusic3Transformer1DTesterConfig, with 4 heads of 8 (theirs: 2; worlds 2 and 4 split them)
    tests=Tests(configs={"tiny": dict(in_channels=8, condition_dim=16, num_layers=2, num_attention_heads=4,
                                      attention_head_dim=8, ff_inner_dim=32, rotary_dim=4, fourier_embedding_dim=8)}),
)
