"""Qwen3-VL (transformers), the text encoder of QwenImage-2.1 (`Qwen3VLForConditionalGeneration`) and Krea 2
(`Qwen3VLModel`). transformers' plan for it (`Qwen3VLTextConfig.base_model_tp_plan`) names the vocabulary-parallel
embedding only, so the decoder layers' plans are written here, the same as transformers' Qwen3 plan: q/k/v and
gate/up colwise, o/down rowwise, the per-head q/k norms (over `head_dim`) replicated with their gradients summed. The
embedding keeps transformers' own entry; the vision tower stays whole. Keyed by qualified class name: nothing here
imports transformers.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from surgery.extend import Family, TensorParallel

_MODELING = "transformers.models.qwen3_vl.modeling_qwen3_vl"

ATTENTION_TP_PLAN = {
    "q_proj": ColwiseParallel(),
    "k_proj": ColwiseParallel(),
    "v_proj": ColwiseParallel(),
    "o_proj": RowwiseParallel(),
    # norms over head_dim on [batch, seq, heads, head_dim]: the weight whole, its gradient summed over the heads'
    # ranks (the input declared sharded on the heads dim); no collective in forward
    "q_norm": SequenceParallel(sequence_dim=-2, use_local_output=True),
    "k_norm": SequenceParallel(sequence_dim=-2, use_local_output=True),
}
MLP_TP_PLAN = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}

FAMILY = Family(
    name="qwen3-vl",
    model_class=f"{_MODELING}.Qwen3VLForConditionalGeneration",
    tp=TensorParallel(
        plans={f"{_MODELING}.Qwen3VLTextAttention": ATTENTION_TP_PLAN, f"{_MODELING}.Qwen3VLTextMLP": MLP_TP_PLAN},
    ),
)
