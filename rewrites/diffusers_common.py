"""Modules diffusers shares across model families: their stock tensor-parallel plans, written once.

`diffusers.models.attention.FeedForward` with a plain activation (GELU, tanh-GELU, approximate GELU, SiLU): the
up projection column-sharded, the down projection rowwise (one all-reduce). Its gated variants (GEGLU, SwiGLU) fuse
gate and up in `net.0.proj` and are refused: a model family that uses them rewrites them first.

diffusers' generic `Attention` is planned in rewrites/qwenimage.py (for the processors that split heads by head_dim,
QwenImage's and the head-dim twins of `surgery.core.leaves`).

`surgery.core.split_projection.SPLIT_PROJECTION_TP_PLAN` is not registered by class: the blocks that hold a
`SplitProjection` compose it under its path in their own literal plans (`surgery.core.leaves.under`).
"""

from __future__ import annotations

import torch.nn as nn
from diffusers.models.activations import GEGLU, SwiGLU
from diffusers.models.attention import FeedForward
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery.core.errors import SurgeryError
from surgery.core.registry import Family

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
