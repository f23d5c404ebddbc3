"""`MiniMaxMusic3RVQDepthDecoder` (diffusers `minimax_music3_rvq_depth_decoder.py`): the `minimax-music3-depth`
family, MiniMax Music 3's local language model (a small causal decoder over one audio frame's residual codebooks).

Nothing is fused. Its processor reshapes by the stored head count (`view(batch, seq, attn.heads, attn.head_dim)`):
its head-dim twin reads `-1` heads (`register_edits`, drift-tested). The block holds its SwiGLU MLP as Linears of its
own (`down_proj(silu(gate_proj(x)) * up_proj(x))`), so the block's plan names them beside the attention's
projections: gate and up colwise, down rowwise; 2 all-reduces per block. The codebook heads and embeddings sit
outside the blocks, whole on every rank.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from diffusers.models.transformers.minimax_music3_rvq_depth_decoder import (
    MiniMaxMusic3DepthAttention,
    MiniMaxMusic3DepthAttnProcessor,
    MiniMaxMusic3DepthDecoderBlock,
    MiniMaxMusic3RVQDepthDecoder,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery.extend import Processors, TensorParallel, Tests, derived_family, register_edits, swap_rewrite

register_edits(MiniMaxMusic3DepthAttnProcessor, "__call__",
               (("seq_len, attn.heads, attn.head_dim", "seq_len, -1, attn.head_dim", 3),))
# a processor swapped, no weight sliced: a checkpoint is the same in both layouts
ATTENTION = replace(swap_rewrite("minimax_music3_rvq_depth_decoder.attention: heads by head_dim",
                                 MiniMaxMusic3DepthAttention,
                                 processors=Processors((MiniMaxMusic3DepthAttnProcessor,))), in_checkpoints=False)

BLOCK_TP_PLAN = {
    "attn.to_q": ColwiseParallel(),
    "attn.to_k": ColwiseParallel(),
    "attn.to_v": ColwiseParallel(),
    "attn.to_out": RowwiseParallel(),
    "gate_proj": ColwiseParallel(),
    "up_proj": ColwiseParallel(),
    "down_proj": RowwiseParallel(),
}


def depth_decoder_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                         dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `MiniMaxMusic3RVQDepthDecoder.forward`: a depth sequence of projected embeddings,
    as many steps as its position table holds (`image_tokens` at most)."""
    generator = torch.Generator().manual_seed(seed)
    steps = min(image_tokens, config.get("max_position_embeddings", 16))
    embeds = torch.randn(batch, steps, config.get("hidden_size", 4096), generator=generator)
    return {"inputs_embeds": embeds.to(device=device, dtype=dtype)}


FAMILY = derived_family(
    "minimax-music3-depth", MiniMaxMusic3RVQDepthDecoder,
    rewrites=(ATTENTION,),
    variants={"music3": dict(hidden_size=4096, num_layers=4, num_attention_heads=16, intermediate_size=6144,
                             audio_vocab_size=1024, num_codebooks=8, max_position_embeddings=16)},
    sources="MiniMaxMusic3RVQDepthDecoder's defaults in diffusers 0.42.1; diffusers "
    "scripts/convert_minimax_music3_to_diffusers.py reads them from the checkpoint's qwen_7B/config.json "
    "(hidden_size, decoder_num_layers, decoder_num_heads, decoder_intermediate_size, audio_vocab_size, "
    "audio_num_codebooks), not read here",
    default_variant="music3",
    example_inputs=depth_decoder_inputs,
    tp=TensorParallel(plans={MiniMaxMusic3DepthDecoderBlock: BLOCK_TP_PLAN}),
    # diffusers has no model test of it: its structure at tiny widths (4 heads of 8: worlds 2 and 4 split them)
    tests=Tests(configs={"tiny": dict(hidden_size=32, num_layers=2, num_attention_heads=4, intermediate_size=64,
                                      audio_vocab_size=16, num_codebooks=8, max_position_embeddings=16)}),
)
