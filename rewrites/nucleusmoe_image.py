"""NucleusMoE-Image (diffusers `transformer_nucleusmoe_image.py`): one image stream cross-attending to per-block
projected text, with expert-choice Mixture-of-Experts feed-forwards (routed SwiGLU experts plus a shared expert).

| module                                  | unfused                                                              | sharded                                        |
|-----------------------------------------|----------------------------------------------------------------------|------------------------------------------------|
| `SwiGLUExperts.gate_up_proj` `[E, H, 2I]` | `SplitSwiGLUExperts.gate_proj`, `.up_proj` `[E, H, I]` (last dim cut) | gate, up `Shard(2)`; `down_proj` `Shard(1)`    |
| `NucleusMoELayer`                       | as is (its shared expert's SwiGLU split by rewrites/ovis_image.py)   | router whole; routed + shared summed, 1 all-reduce |
| `Attention` (grouped-query processor)   | as is                                                                | derived: DTensor q/k/v, 1 all-reduce           |
| block `img_mod.1`, `encoder_proj`       | as is                                                                | whole on every rank                            |

The routed experts keep diffusers' own loop (and grouped-GEMM) code, edited in one place each: the fused
`x @ gate_up_proj[e]` then `chunk(2)` becomes `x @ gate_proj[e]` and `x @ up_proj[e]` (`register_edits`, checked
against the installed source by tests/core/test_drift.py). Sharded, each rank holds the same columns of every
expert's gate and up and the matching rows of its down projection, so each rank's expert output is its share of a
sum: `silu(x G) * (x U)` is column-wise, so `sum_r [silu(x G_r) * (x U_r)] D_r = [silu(x G) * (x U)] D`. The
layer's forward runs as diffusers wrote it, on DTensors (`ImplicitReplication`): the router, the top-k and the
gathers on replicated values, the routed output a `Partial` DTensor times the replicated gating, scattered into the
shared expert's `Partial` output (`scatter_add` is linear in both: `surgery.parallel.dtensor_attention` gives DTensor
that rule), and the sum
resolved once at the layer's output: one all-reduce per MoE layer, as per dense feed-forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_nucleusmoe_image import (
    NucleusMoEImageTransformer2DModel,
    NucleusMoEImageTransformerBlock,
    NucleusMoELayer,
    SwiGLUExperts,
)
from torch.distributed.tensor import Partial, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery.core.leaves import recast, twin
from surgery.extend import Rewrite, Slice, TensorParallel, Tests, derived_family, register_edits
from surgery.parallel.styles import ImplicitReplication, ShardParameters

# each expert's fused gate/up product, read as its two halves' products
_FUSED_GATE_UP = "gate, up = gate_up.chunk(2, dim=-1)"
register_edits(SwiGLUExperts, "_run_experts_for_loop", (
    ("gate_up = torch.matmul(x_expert, self.gate_up_proj[expert_idx])",
     "gate_up = torch.matmul(x_expert, self.gate_proj[expert_idx]), torch.matmul(x_expert, self.up_proj[expert_idx])",
     1),
    (_FUSED_GATE_UP, "gate, up = gate_up", 1),
))
register_edits(SwiGLUExperts, "_run_experts_grouped_mm", (
    ("gate_up = F.grouped_mm(x, self.gate_up_proj, offs=offsets)",
     "gate_up = F.grouped_mm(x, self.gate_proj, offs=offsets), F.grouped_mm(x, self.up_proj, offs=offsets)", 1),
    (_FUSED_GATE_UP, "gate, up = gate_up", 1),
))
SplitSwiGLUExperts = twin(SwiGLUExperts, "SplitSwiGLUExperts", method=("_run_experts_for_loop",
                                                                      "_run_experts_grouped_mm"))

GATE_UP, GATE, UP = "gate_up_proj", "gate_proj", "up_proj"


def _expert_slices(experts: nn.Module) -> list[Slice]:
    # the intermediate width from the down projection, the same in both forms
    width = experts.down_proj.shape[1]
    return [Slice(GATE_UP, GATE, 2, 0, width), Slice(GATE_UP, UP, 2, width, 2 * width)]


def _with_parameters(experts: nn.Module, cls: type, names: tuple[str, ...]) -> nn.Module:
    """A recast of `experts` as `cls` holding parameters `names` (empty, on meta: the engine fills them) then
    `down_proj`, in diffusers' order."""
    new = recast(experts, cls)
    down = new._parameters["down_proj"]
    new._parameters.clear()
    for name in names:
        new._parameters[name] = nn.Parameter(torch.empty(0, device="meta"))
    new._parameters["down_proj"] = down
    return new


EXPERTS = Rewrite(
    name="nucleusmoe_image.experts: gate and up",
    fused=SwiGLUExperts,
    unfused=SplitSwiGLUExperts,
    slices=_expert_slices,
    build_unfused=lambda m: _with_parameters(m, SplitSwiGLUExperts, (GATE, UP)),
    build_fused=lambda m: _with_parameters(m, SwiGLUExperts, (GATE_UP,)),
)


# The MoE layer: routed experts' gate/up columns and down rows, the shared expert's SwiGLU colwise and its down
# projection rowwise, all left as DTensors; the layer's own style (last) replicates the router and resolves the sum.
MOE_LAYER_TP_PLAN = {
    "experts": ShardParameters({GATE: Shard(2), UP: Shard(2), "down_proj": Shard(1)}),
    "shared_expert.net.0.proj_up": ColwiseParallel(use_local_output=False),
    "shared_expert.net.0.proj_gate": ColwiseParallel(use_local_output=False),
    "shared_expert.net.2": RowwiseParallel(output_layouts=Partial(), use_local_output=False),
    "": ImplicitReplication(sum_output=True),
}


def nucleus_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `NucleusMoEImageTransformer2DModel.forward`, as its pipeline passes them: one
    image of `image_tokens` patches (`img_shapes` per sample), text of `text_tokens` with the last token of every
    sample but the first masked as padding, the timestep in [0, 1]."""
    generator = torch.Generator().manual_seed(seed)
    height = max(d for d in range(1, math.isqrt(image_tokens) + 1) if image_tokens % d == 0)
    mask = torch.ones(batch, text_tokens, dtype=torch.bool)
    mask[1:, -1] = False
    inputs = dict(
        hidden_states=torch.randn(batch, image_tokens, config.get("in_channels", 64), generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("joint_attention_dim", 3584),
                                          generator=generator),
        encoder_hidden_states_mask=mask,
        timestep=torch.rand(batch, generator=generator),
    )
    inputs = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
    return dict(inputs, img_shapes=[[(1, height, image_tokens // height)]] * batch)


def _tiny(**config) -> dict:
    return dict(dict(patch_size=2, in_channels=16, out_channels=4, joint_attention_dim=16, axes_dims_rope=(2, 2, 4),
                     dense_moe_strategy="leave_first_block_dense", num_experts=4, moe_intermediate_dim=32,
                     capacity_factors=2.0), **config)


FAMILIES = (
    derived_family(
        "nucleusmoe-image", NucleusMoEImageTransformer2DModel,
        variants={"nucleusmoe-image": dict(
            patch_size=2, in_channels=64, out_channels=16, num_layers=32, attention_head_dim=128,
            num_attention_heads=16, num_key_value_heads=4, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56),
            mlp_ratio=4.0, moe_enabled=True, dense_moe_strategy="leave_first_three_blocks_dense", num_experts=64,
            moe_intermediate_dim=1344, capacity_factors=[0.0] * 3 + [4.0] * 2 + [2.0] * 27, use_sigmoid=False,
            route_scale=2.5, use_grouped_mm=True)},
        sources="Nucleus-Image transformer/config.json (as stored at huggingface.co/FenomAI/Nucleus-Image, written by "
        "diffusers 0.38.0.dev0): 32 blocks, 16 query heads of 128 over 4 key/value heads, 64 experts 1344 wide, the "
        "first three blocks dense, grouped GEMMs",
        default_variant="nucleusmoe-image",
        example_inputs=nucleus_inputs,
        rewrites=(EXPERTS,),
        tp=TensorParallel(
            plans={NucleusMoELayer: MOE_LAYER_TP_PLAN},
            replicated={
                NucleusMoEImageTransformerBlock: {
                    "img_mod.1": "adaptive-norm modulation of the replicated timestep embedding",
                    "encoder_proj": "the text features projected to the model width, read whole by the attention's "
                                    "colwise key/value projections",
                },
                NucleusMoELayer: {"gate": "the router: every rank picks the same tokens for every expert"},
            },
        ),
        tests=Tests(configs={
            # 8 query heads over 4 key/value heads (grouped-query), one dense block then two MoE blocks
            "tiny": _tiny(num_layers=3, num_attention_heads=8, num_key_value_heads=4, attention_head_dim=8),
            "all_moe": _tiny(num_layers=1, num_attention_heads=2, attention_head_dim=16, axes_dims_rope=(4, 6, 6),
                             dense_moe_strategy="all_moe", num_experts=3, moe_intermediate_dim=24),
        }),
    ),
)
