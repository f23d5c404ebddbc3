"""UMT5 (transformers), the text encoder of Wan 2.x and SkyReels-V2 (`UMT5EncoderModel`, google/umt5-xxl): transformers
ships no tensor-parallel plan for it, so this is a literal stock one, as for T5 (`rewrites/t5.py`).

Unlike T5, UMT5's attention views q/k/v by its stored head count (`view(batch, -1, self.n_heads, d_kv)`), which is
wrong on a rank holding `n_heads / N` heads. `unfuse` swaps each `UMT5Attention` for its head-dim twin (the stock
forward with the edits listed below, drift-tested); nothing else changes, and `fuse` gives the
stock class back. Every layer holds its own relative attention bias (`[num_buckets, num_heads]`): column-sharded with
the heads, so each rank computes its own heads' bias. The shared token embedding stays whole.
"""

from __future__ import annotations

from surgery.core.leaves import recast, twin
from surgery.extend import Family, Rewrite, TensorParallel, register_edits
# T5's literal plans and head check serve UMT5 as they are: the same submodule names (q, k, v, o, wi, wo)
from surgery_rewrites.t5 import ATTENTION_TP_PLAN, GATED_MLP_TP_PLAN, MLP_TP_PLAN, check_heads

# The head-dim twin is built from transformers' own source, so this family needs transformers imported; without it no
# UMT5 model can exist in this process and there is nothing to register (a transformer-only user has no transformers).
try:
    from transformers.models.umt5 import modeling_umt5 as M  # optional: only where transformers is installed
except ImportError:
    M = None


def _family() -> Family:
    # UMT5's attention views q/k/v by the stored head count, where T5's uses -1: split by head_dim instead; the zero bias
    # of a layer without relative attention bias (decoder cross-attention) counts the heads the rank holds.
    register_edits(M.UMT5Attention, "forward", (
        (".view(batch_size, -1, self.n_heads, self.key_value_proj_dim)", ".unflatten(-1, (-1, self.key_value_proj_dim))", 3),
        ("(1, self.n_heads, seq_length, key_length)", "(1, query_states.shape[1], seq_length, key_length)", 1),
    ))
    HeadDimUMT5Attention = twin(M.UMT5Attention, "HeadDimUMT5Attention", "forward")

    # The same parameters in both forms (nothing to slice): only the attention's class changes.
    HEADS_BY_HEAD_DIM = Rewrite(
        name="umt5_attention_heads_by_head_dim",
        fused=M.UMT5Attention,
        unfused=HeadDimUMT5Attention,
        slices=lambda module: [],
        build_unfused=lambda module: recast(module, HeadDimUMT5Attention),
        build_fused=lambda module: recast(module, M.UMT5Attention),
        in_checkpoints=False,
    )

    FAMILY = Family(
        name="umt5",
        model_class=M.UMT5EncoderModel,
        rewrites=(HEADS_BY_HEAD_DIM,),
        tp=TensorParallel(
            plans={
                HeadDimUMT5Attention: ATTENTION_TP_PLAN,
                M.UMT5DenseGatedActDense: GATED_MLP_TP_PLAN,
                M.UMT5DenseActDense: MLP_TP_PLAN,
            },
            checks={HeadDimUMT5Attention: check_heads},
        ),
    )
    return FAMILY


FAMILIES = () if M is None else (_family(),)
