"""`HiDreamImageTransformer2DModel` (diffusers `transformer_hidream_image.py`): the `hidream` family.

HiDream-I1, derived from diffusers' building blocks (`surgery.extend.derived_family`): data only (the published config
with its source, tiny test configs, example inputs).

Derived: its attention (`HiDreamAttention`, image and text streams `to_*` / `to_*_t`, `to_out` the Linear itself) by
heads, with the processor rule's head-dim twin of `HiDreamAttnProcessor` and its `torch.nn.RMSNorm` q/k norms across
heads computed elementwise, so each shards by its statistic; its SwiGLU feed-forwards (`w1`, `w3` colwise, `w2`
rowwise), the text stream's and every one of the MoE's (`MOEFeedForwardSwiGLU`: the shared experts and each routed
expert). The router (`MoEGate`, a bare weight) stays whole: it reads the block's replicated hidden states, so every
rank picks the same experts with the same weights. Each expert's `w2` reduces its own output, so the routing weight
multiplies a whole expert output, as on one device, and the router's gradient is whole too.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_hidream_image import (
    HiDreamAttention,
    HiDreamImageTransformer2DModel,
    TextProjection,
)

from surgery.extend import TensorParallel, Tests, derived_family
from surgery_rewrites.diffusers_common import cast_inputs


def hidream_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `HiDreamImageTransformer2DModel.forward`: a square latent of `image_tokens`
    patches, T5 features, the Llama hidden states of every layer `llama_layers` names (`[layers, batch, tokens,
    dim]`), the pooled CLIP embedding and a timestep."""
    generator = torch.Generator().manual_seed(seed)
    side = int(image_tokens ** 0.5) * config["patch_size"]
    t5, llama = config["caption_channels"][0], config["caption_channels"][1]
    inputs = dict(
        hidden_states=torch.randn(batch, config.get("in_channels", 64), side, side, generator=generator),
        timesteps=torch.rand(batch, generator=generator) * 1000,
        encoder_hidden_states_t5=torch.randn(batch, text_tokens, t5, generator=generator),
        encoder_hidden_states_llama3=torch.randn(max(config["llama_layers"]) + 1, batch, text_tokens, llama,
                                                 generator=generator),
        pooled_embeds=torch.randn(batch, config.get("text_emb_dim", 2048), generator=generator),
    )
    return cast_inputs(inputs, dtype, device)


# HiDream-ai/HiDream-I1-Full transformer/config.json (Dev and Fast share it), as HiDream's conversion to diffusers
# writes it; the class's defaults (patch_size None, caption_channels None) build nothing
_HIDREAM_I1 = dict(patch_size=2, in_channels=16, out_channels=16, num_layers=16, num_single_layers=32,
                   attention_head_dim=128, num_attention_heads=20, caption_channels=[4096, 4096], text_emb_dim=2048,
                   num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(64, 32, 32),
                   max_resolution=(128, 128), llama_layers=list(range(32)) + [31] * 16)


_HIDREAM_TINY = dict(patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1,
                     attention_head_dim=16, num_attention_heads=4, caption_channels=[8, 4], text_emb_dim=8,
                     num_routed_experts=2, num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(32, 32),
                     llama_layers=(0, 1))


FAMILY = derived_family(
    "hidream", HiDreamImageTransformer2DModel, attention=(HiDreamAttention,),
    variants={"i1": _HIDREAM_I1},
    sources="HiDream-ai/HiDream-I1-Full transformer/config.json (HiDream-I1-Dev and -Fast: the same), as "
    "HiDream's convert_hidream_to_diffusers.py writes it",
    default_variant="i1",
    example_inputs=hidream_inputs,
    tp=TensorParallel(
        replicated={TextProjection: {"linear": "a text encoder's features projected ahead of the blocks (one "
                                               "projection per block, text tokens only); every rank holds them whole"}},
    ),
    tests=Tests(
        # Each expert's w2 is rowwise: its output is reduced before the routing weight multiplies it, so the router's
        # gradient sees whole expert outputs. Inference (`moe_infer`) skips an expert no token was routed to, so a
        # forward makes 1 + (experts routed to) all-reduces per MoE: the derived count (every expert) holds where
        # every expert gets a token, always at 2 of 2 (diffusers' own test config), which the sharded case uses;
        # `tiny_routed` (2 of 4) checks the routing against stock
        configs={"tiny": _HIDREAM_TINY, "tiny_routed": {**_HIDREAM_TINY, "num_routed_experts": 4}},
    ),
)
