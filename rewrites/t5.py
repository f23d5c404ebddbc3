"""T5 (transformers), the text encoder of FLUX.1, Chroma and Bria (`T5EncoderModel`, T5-XXL v1.1): transformers ships
no tensor-parallel plan for it, so this is a literal stock one. Keyed by qualified class name: nothing here imports
transformers.

Heads are split across ranks (the forward reshapes with -1 heads). The relative attention bias (an `Embedding` of
`[num_buckets, num_heads]`, in the first block only) is per head: it is column-sharded with the heads, so block 0
computes each rank's own heads' bias and passes it to the later blocks, as on one device. The shared token embedding
(`shared`, tied to `encoder.embed_tokens`) stays whole.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery.core.checks import mesh_sizes_dividing
from surgery.core.errors import SurgeryError
from surgery.extend import Family, TensorParallel

_MODELING = "transformers.models.t5.modeling_t5"

ATTENTION_TP_PLAN = {
    "q": ColwiseParallel(),
    "k": ColwiseParallel(),
    "v": ColwiseParallel(),
    "o": RowwiseParallel(),
    "relative_attention_bias": ColwiseParallel(),  # Embedding [buckets, heads]: each rank's heads' columns
}

GATED_MLP_TP_PLAN = {"wi_0": ColwiseParallel(), "wi_1": ColwiseParallel(), "wo": RowwiseParallel()}
MLP_TP_PLAN = {"wi": ColwiseParallel(), "wo": RowwiseParallel()}


def check_heads(module: nn.Module, path: str, world: int) -> None:
    heads = module.n_heads
    if heads % world:
        raise SurgeryError(
            f"surgery.tensor_parallel: '{path}' has num_heads={heads}, which a mesh of {world} cannot split into "
            f"whole heads. Use a mesh size that divides {heads}: {mesh_sizes_dividing(heads)}."
        )


FAMILY = Family(
    name="t5",
    model_class=f"{_MODELING}.T5EncoderModel",
    tp=TensorParallel(
        plans={
            f"{_MODELING}.T5Attention": ATTENTION_TP_PLAN,
            f"{_MODELING}.T5DenseGatedActDense": GATED_MLP_TP_PLAN,
            f"{_MODELING}.T5DenseActDense": MLP_TP_PLAN,
        },
        checks={f"{_MODELING}.T5Attention": check_heads},
    ),
)
