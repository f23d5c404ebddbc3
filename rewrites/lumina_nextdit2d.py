"""`LuminaNextDiT2DModel` (diffusers `lumina_nextdit2d.py`): the `lumina-next` family (Lumina-Next-SFT, a
grouped-query DiT with a gated cross-attention to Gemma's caption features).

Derived (`surgery.extend.derived_family`): its processor (`LuminaAttnProcessor2_0`) reads the stored head count for
more than a reshape (the per-head mask it expands), so it runs unmodified on DTensor q/k/v
(`surgery.parallel.dtensor_attention`); the attentions hand the block their heads-sharded outputs, and the block's
per-head `gate` over the cross-attention's heads is split like the heads (`PerHeadParameters`, derived). Its q/k norms
are `nn.LayerNorm`s across all heads (`layer_norm_across_heads`): `surgery.unfuse` computes them elementwise
(`norms_across_heads`, `ElementwiseLayerNorm`), so a rank's share of the heads normalizes by two all-reduces of a
number per token (the mean and the variance).
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina
from diffusers.models.transformers.lumina_nextdit2d import LuminaNextDiT2DModel

from surgery.core.norms import norms_across_heads
from surgery.extend import Tests, derived_family


def lumina_next_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `LuminaNextDiT2DModel.forward`, as diffusers' LuminaPipeline builds them: a square
    latent of `image_tokens` patches, the caption features of `cross_attention_dim` and their 0/1 mask (the last
    token of each caption after the first padded), and the complex 2-D rotary table of the head size
    (`get_2d_rotary_pos_embed_lumina`, over the latent's patches)."""
    generator = torch.Generator().manual_seed(seed)
    patch = config.get("patch_size", 2)
    side = int(image_tokens ** 0.5)
    mask = torch.ones(batch, text_tokens, dtype=torch.long)
    mask[1:, -1] = 0
    head_dim = config.get("hidden_size", 2304) // config.get("num_attention_heads", 32)
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 4), side * patch, side * patch,
                                  generator=generator),
        timestep=torch.rand(batch, generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("cross_attention_dim", 2048),
                                          generator=generator),
    )
    inputs = {k: v.to(device=device, dtype=dtype) for k, v in inputs.items()}
    # the forward runs `**cross_attention_kwargs`: the pipeline passes a dict, and so must a caller
    return {**inputs, "encoder_mask": mask.to(device), "cross_attention_kwargs": {},
            "image_rotary_emb": get_2d_rotary_pos_embed_lumina(head_dim, side, side).to(device)}


FAMILY = derived_family(
    "lumina-next", LuminaNextDiT2DModel, attention=(Attention,),
    rewrites=(norms_across_heads("lumina_nextdit2d.attention: q/k layer norms across heads", Attention),),
    variants={"sft": dict(sample_size=128, patch_size=2, in_channels=4, hidden_size=2304, num_layers=24,
                          num_attention_heads=32, num_kv_heads=8, multiple_of=256, ffn_dim_multiplier=None,
                          norm_eps=1e-5, learn_sigma=True, qk_norm=True, cross_attention_dim=2048,
                          scaling_factor=1.0)},
    sources="Alpha-VLLM/Lumina-Next-SFT-diffusers as diffusers' scripts/convert_lumina_to_diffusers.py builds it "
    "(24 layers, 32 query and 8 key/value heads of 72, hidden 2304, Gemma-2B's 2048-wide caption features); its "
    "config.json unverified here",
    default_variant="sft",
    example_inputs=lumina_next_inputs,
    tests=Tests(
        # diffusers' LuminaNextDiTTesterConfig (tests/models/transformers/test_models_transformer_lumina.py) with 8
        # query and 4 key/value heads of 4 (theirs: 3 and 1 of 8) so that meshes of 2 and 4 split both counts
        configs={"tiny": dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=32, num_layers=2,
                              num_attention_heads=8, num_kv_heads=4, multiple_of=16, ffn_dim_multiplier=None,
                              norm_eps=1e-5, learn_sigma=False, qk_norm=True, cross_attention_dim=32,
                              scaling_factor=1.0)},
    ),
)
