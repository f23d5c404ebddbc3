"""QwenImage-2.1 (diffusers `QwenImage21Transformer2DModel`): nothing fused, so no rewrite; stock plans only.

Its single-stream blocks hold separate, bias-free q/k/v and output projections (`QwenImage21Attention`) and a SwiGLU
feed-forward with separate gate and up projections (`QwenImage21SwiGLUFeedForward`). Both processors split heads by
`head_dim`, so they run unchanged on each rank's share of the heads. The plans are derived
(`surgery.extend.derived_family`) and equal diffusers' own `_tp_plan` for this class (tests/parallel/test_derive.py), plus
the QK-norms as per-head norms; same collectives: two all-reduces per block.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Transformer2DModel

from surgery.core.errors import SurgeryError
from surgery.extend import Tests, derived_family

# QwenImage21Transformer2DModel's defaults, which diffusers documents as Qwen-Image 2.1's configuration.
VARIANTS = {
    "qwen-image-2.1": dict(
        patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128, num_attention_heads=32,
        context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56), eps=1e-6, causal_condition=True,
    ),
}

_TOKENS_PER_SLOT = 4  # each vision-language image slot stands for 2x2 latent tokens


def example_inputs(
    config: dict,
    batch: int = 1,
    image_tokens: int = 16,
    text_tokens: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict:
    """Seeded keyword arguments for `QwenImage21Transformer2DModel.forward`: text of `text_tokens` then one target
    image of `image_tokens` latent tokens (a multiple of 4; 2x2 tokens per vision-language slot), the last text
    token of every sample but the first masked as padding.

    The masks (`img_mask`, `encoder_hidden_states_mask`) stay on the CPU whatever `device` is: the model reads them
    back (`tolist`, `nonzero`) to lay out the joint sequence, which is also why `device="meta"` is refused.
    """
    if torch.device(device).type == "meta":
        raise SurgeryError(
            "QwenImage-2.1's forward reads its masks back (tolist, nonzero, repeat_interleave) to lay out the joint "
            "sequence, so it cannot run on the meta device; its collectives per forward are 2 all-reduces per block."
        )
    if image_tokens % _TOKENS_PER_SLOT:
        raise SurgeryError(f"QwenImage-2.1 takes image tokens in groups of 4 (2x2 per slot); got {image_tokens}.")
    generator = torch.Generator().manual_seed(seed)
    slots = image_tokens // _TOKENS_PER_SLOT
    side = max(d for d in range(1, int(slots**0.5) + 1) if slots % d == 0)
    height, width = 2 * side, 2 * (slots // side)
    img_mask = torch.ones(batch, text_tokens + slots, dtype=torch.bool)
    img_mask[:, :text_tokens] = False
    text_mask = torch.ones(batch, text_tokens, dtype=torch.bool)
    text_mask[1:, -1] = False
    floating = dict(
        hidden_states=torch.randn(batch, image_tokens, config.get("in_channels", 64), generator=generator),
        encoder_hidden_states=torch.randn(batch, text_tokens, config.get("context_in_dim", 4096), generator=generator),
        timestep=torch.rand(batch, generator=generator),
    )
    return dict(
        {k: v.to(device=device, dtype=dtype) for k, v in floating.items()},
        img_shapes=[[(1, height, width)]] * batch,
        img_mask=img_mask,
        encoder_hidden_states_mask=text_mask,
    )


def reduced(config: dict, layers: int = 2, single_layers: int | None = None, head_dim: int = 32) -> dict:
    """A published config at demo size: same head count, MLP ratio and text width; fewer blocks, smaller heads.
    (All of QwenImage-2.1's blocks are single-stream; `single_layers` is accepted and ignored: `layers` counts them.)"""
    if head_dim % 8:
        raise SurgeryError(f"head_dim {head_dim} is not a multiple of 8 (3 rotary axes of even size)")
    quarter = head_dim // 4
    return dict(config, num_layers=layers, attention_head_dim=head_dim, axes_dims_rope=(quarter, quarter, 2 * quarter))


def _small(**config) -> dict:
    rope = {8: (2, 2, 4), 12: (4, 4, 4), 16: (4, 6, 6)}[config["attention_head_dim"]]
    return dict(dict(patch_size=1, in_channels=16, out_channels=16, mlp_ratio=3), axes_dims_rope=rope, **config)


# The first one is sharded at world 2 and 4 (4 heads, widths 32 and 96).
TEST_CONFIGS = {
    "tp_small": _small(num_layers=2, num_attention_heads=4, attention_head_dim=8, context_in_dim=16),
    "no_causal_condition": _small(num_layers=1, num_attention_heads=3, attention_head_dim=12, context_in_dim=24,
                                  causal_condition=False),
}

FAMILY = derived_family(
    "qwen-image-2.1", QwenImage21Transformer2DModel,
    variants=VARIANTS,
    sources="QwenImage21Transformer2DModel's documented defaults (diffusers 0.42.1 transformer_qwenimage21.py)",
    default_variant="qwen-image-2.1",
    example_inputs=example_inputs,
    shrink_config=reduced,
    tests=Tests(configs=TEST_CONFIGS),
)
