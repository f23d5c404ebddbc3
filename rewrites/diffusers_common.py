"""What diffusers' model families share: the stock tensor-parallel plans written once, for every family to reference.

`diffusers.models.attention.FeedForward` with a plain activation (GELU, tanh-GELU, approximate GELU, SiLU): the
up projection column-sharded, the down projection rowwise (one all-reduce). Its gated variants (GEGLU, SwiGLU) fuse
gate and up in `net.0.proj` and are refused: a model family that uses them rewrites them first. It is registered
here, once, because the class is diffusers' own.

The other plans here are literal dicts that several families register for their own classes, which share diffusers'
attention layout (`to_q`, `add_q_proj`, `norm_added_q`, ...): `ATTENTION_TP_PLAN`, `DOUBLE_STREAM_ATTENTION_TP_PLAN`
and FLUX.1's single-stream block, `SINGLE_BLOCK_TP_PLAN`. diffusers' generic `Attention` is registered (with the
double-stream plan) in rewrites/qwenimage.py, for the processors that split heads by head_dim: QwenImage's and the
head-dim twins of `surgery.core.leaves`.

`surgery.core.split_projection.SPLIT_PROJECTION_TP_PLAN` is not registered by class: the blocks that hold a
`SplitProjection` compose it under its path in their own literal plans (`surgery.core.leaves.under`).
"""

from __future__ import annotations

import torch.nn as nn
from diffusers.models.activations import GEGLU, SwiGLU
from diffusers.models.attention import FeedForward
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery.extend import Family, SurgeryError, SPLIT_PROJECTION_TP_PLAN, per_head_norm, under

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


def _check_feed_forward(module: nn.Module, path: str, world: int) -> None:
    activation = module.net[0]
    if isinstance(activation, (GEGLU, SwiGLU)):
        raise SurgeryError(
            f"surgery.tensor_parallel: '{path}.net.0' is a {type(activation).__name__}, whose `proj` fuses gate and up "
            "rows; column sharding would cut across them. Its model family needs a rewrite that splits them first."
        )


FAMILY = Family(
    name="diffusers-common",
    model_class=None,
    tp_plans={FeedForward: FEED_FORWARD_TP_PLAN},
    tp_checks={FeedForward: _check_feed_forward},
)
