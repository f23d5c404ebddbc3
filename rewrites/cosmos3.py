"""`Cosmos3OmniTransformer` (diffusers `transformer_cosmos3.py`): the `cosmos3` family (NVIDIA Cosmos 3, a
Mixture-of-Transformers over one packed sequence: a causal understanding pathway over the text, a bidirectional
generation pathway over the vision latents that attends to both).

Nothing is fused: each pathway has its own q/k/v/out projections (`to_*` for understanding, `add_*_proj` and
`to_add_out` for generation), MLP and norms. Its attention stores its head counts as `num_attention_heads` /
`num_key_value_heads` (grouped-query), which no derivation rule reads, so the attention's plan is written here: q/k/v
of both pathways colwise, both output projections rowwise, the per-head q/k norms on each rank's heads (dim 1 of
`[tokens, heads, head_dim]`). The processor views by those counts (`view(-1, heads, head_dim)`, tokens first): its
head-dim twin splits the last dim by the head size, `unflatten(-1, (-1, head_dim))` (`register_edits`,
drift-tested); a rank's query and key/value heads keep their groups (both counts divide by the
mesh, checked). The MLPs are derived (gate/up colwise, down rowwise). 4 all-reduces per layer.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_cosmos3 import (
    Cosmos3AttnProcessor,
    Cosmos3OmniTransformer,
    Cosmos3PackedMoTAttention,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from surgery.core.checks import mesh_sizes_dividing
from surgery.core.errors import SurgeryError
from surgery.extend import Processors, TensorParallel, Tests, derived_family, register_edits, swap_rewrite
from surgery.parallel.derive import per_head_norm

# q/k/v are `[tokens, width]`: the key/value edit splits dim 1, the query's dim -1 (the same dim, spelled apart so
# that each edit reads back to its own stock text)
register_edits(Cosmos3AttnProcessor, "__call__", (
    ("view(-1, attn.num_attention_heads, attn.head_dim)", "unflatten(-1, (-1, attn.head_dim))", 2),
    ("view(-1, attn.num_key_value_heads, attn.head_dim)", "unflatten(1, (-1, attn.head_dim))", 4),
))
# a processor swapped, no weight sliced: a checkpoint is the same in both layouts
ATTENTION = replace(swap_rewrite("cosmos3.attention: heads by head_dim", Cosmos3PackedMoTAttention,
                                 processors=Processors((Cosmos3AttnProcessor,))), in_checkpoints=False)

HEAD_NORM = per_head_norm(1)  # q/k as [tokens, heads, head_dim]: each rank's own heads
ATTENTION_TP_PLAN = {
    **dict.fromkeys(("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"), ColwiseParallel()),
    "to_out": RowwiseParallel(),
    "to_add_out": RowwiseParallel(),
    **dict.fromkeys(("norm_q", "norm_k", "k_norm_und_for_gen", "norm_added_q", "norm_added_k"), HEAD_NORM),
}


def check_heads(module: nn.Module, path: str, world: int) -> None:
    """Query and key/value heads both split evenly: each rank then holds whole query groups with their kv head."""
    for count, kind in ((module.num_attention_heads, "query heads"), (module.num_key_value_heads, "key/value heads")):
        if count % world:
            raise SurgeryError(f"surgery.tensor_parallel: '{path}' holds {count} {kind} of {module.head_dim}, which a "
                               f"mesh of {world} cannot split evenly. Use a mesh size that divides {count}: "
                               f"{mesh_sizes_dividing(count)}.")


def cosmos3_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `Cosmos3OmniTransformer.forward`, as diffusers' own model test builds them: one
    packed sequence (the model takes no batch: `batch` is not used) of `text_tokens` text ids, then one noisy image
    latent of `image_tokens` patches; mRoPE positions counting along the sequence."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5)
    patch = config.get("latent_patch_size", 2)
    length = text_tokens + side * side
    vision = torch.arange(text_tokens, length)
    return dict(
        input_ids=torch.randint(0, config.get("vocab_size", 151936), (text_tokens,), generator=generator).to(device),
        text_indexes=torch.arange(text_tokens, device=device),
        position_ids=torch.arange(length).repeat(3, 1).to(device),
        und_len=text_tokens,
        sequence_length=length,
        vision_tokens=[torch.randn(1, config.get("latent_channel", 48), 1, side * patch, side * patch,
                                   generator=generator).to(device=device, dtype=dtype)],
        vision_token_shapes=[(1, side, side)],
        vision_sequence_indexes=vision.to(device),
        vision_mse_loss_indexes=vision.to(device),
        vision_timesteps=torch.rand(side * side, generator=generator).to(device=device, dtype=dtype),
        vision_noisy_frame_indexes=[torch.tensor([0], device=device)],
    )


FAMILY = derived_family(
    "cosmos3", Cosmos3OmniTransformer,
    rewrites=(ATTENTION,),
    variants={"nano": dict(head_dim=128, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                           num_hidden_layers=36, num_key_value_heads=8, latent_channel=48, latent_patch_size=2,
                           patch_latent_dim=192, vocab_size=151936, hidden_act="silu", qk_norm_for_text=True)},
    sources="Cosmos3OmniTransformer's defaults in diffusers 0.42.1 (a Qwen3-8B backbone: 36 layers, 32 query / 8 "
    "key-value heads of 128, hidden 4096, MLP 12288; Wan 2.2 latents of 48 channels in 2 x 2 patches); the published "
    "nvidia/Cosmos3-Nano and Cosmos3-Super config.json files (diffusers' cosmos3 docs) were not read here",
    default_variant="nano",
    example_inputs=cosmos3_inputs,
    tp=TensorParallel(plans={Cosmos3PackedMoTAttention: ATTENTION_TP_PLAN},
                      checks={Cosmos3PackedMoTAttention: check_heads}),
    tests=Tests(configs={
        # the published structure (SiLU MLPs, per-head q/k norms on both pathways) at tiny widths: 8 query heads over
        # 4 key/value heads of 8 (grouped-query; worlds 2 and 4 split both), mRoPE axes (2, 1, 1)
        "tiny": dict(head_dim=8, hidden_act="silu", hidden_size=16, intermediate_size=32, latent_channel=2,
                     latent_patch_size=1, num_attention_heads=8, num_hidden_layers=2, num_key_value_heads=4,
                     patch_latent_dim=2, qk_norm_for_text=True, rms_norm_eps=1e-5, rope_axes_dim=[2, 1, 1],
                     rope_theta=1e8, vocab_size=32),
        # diffusers' Cosmos3OmniTransformerTesterConfig (the Nemotron "edge" layout: relu2 MLPs, no text q/k norm)
        # with the heads above, and the understanding keys' own norm for the generation pathway
        "edge_tiny": dict(head_dim=8, hidden_act="relu2", hidden_size=16, intermediate_size=32, latent_channel=2,
                          latent_patch_size=1, num_attention_heads=8, num_hidden_layers=2, num_key_value_heads=4,
                          patch_latent_dim=2, qk_norm_for_text=False, use_und_k_norm_for_gen=True, rms_norm_eps=1e-5,
                          rope_axes_dim=[2, 1, 1], rope_theta=1e8, vocab_size=32),
    }),
)
