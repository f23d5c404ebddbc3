"""Qwen3 (transformers), the text encoder of FLUX.2-klein: its projections are already separate, so it needs no
rewrite, only stock tensor-parallel plans. Keyed by qualified class name: nothing here imports transformers."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery.checks import SurgeryError, mesh_sizes_dividing
from surgery.registry import Family
from surgery.tensor_parallel import per_head_norm

_MODELING = "transformers.models.qwen3.modeling_qwen3"

# q/k/v heads split across ranks (forward reshapes with -1 heads); QK-norms on [batch, seq, heads, head_dim].
ATTENTION_TP_PLAN = {
    "q_proj": ColwiseParallel(),
    "k_proj": ColwiseParallel(),
    "v_proj": ColwiseParallel(),
    "q_norm": per_head_norm(2),
    "k_norm": per_head_norm(2),
    "o_proj": RowwiseParallel(),
}

MLP_TP_PLAN = {
    "gate_proj": ColwiseParallel(),
    "up_proj": ColwiseParallel(),
    "down_proj": RowwiseParallel(),
}


def _check_heads(module: nn.Module, path: str, world: int) -> None:
    config = module.config
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name)
        if heads % world:
            raise SurgeryError(
                f"surgery.tensor_parallel: '{path}' has {name}={heads}, which a mesh of {world} cannot split into "
                f"whole heads. Use a mesh size that divides {heads}: {mesh_sizes_dividing(heads)}."
            )


FAMILY = Family(
    name="qwen3",
    model_class=f"{_MODELING}.Qwen3Model",
    tp_plans={f"{_MODELING}.Qwen3Attention": ATTENTION_TP_PLAN, f"{_MODELING}.Qwen3MLP": MLP_TP_PLAN},
    tp_checks={f"{_MODELING}.Qwen3Attention": _check_heads},
)
