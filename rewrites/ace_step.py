"""ACE-Step 1.5 (diffusers `ace_step_transformer.py`): a 1-D music DiT with grouped-query self attention (alternating
sliding-window and full) and cross attention to the packed text, lyrics and timbre condition. Plans, the attention
path and the all-reduce count are derived."""

from __future__ import annotations

import torch
from diffusers.models.transformers.ace_step_transformer import AceStepAttention, AceStepTransformer1DModel

from surgery.extend import Tests, derived_family


def ace_step_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `AceStepTransformer1DModel.forward`, as diffusers' own model test builds them:
    `image_tokens` latent frames, the timesteps `t` and `r`, the condition encoder's output and the context latents
    (source latents and chunk masks, twice the acoustic width)."""
    generator = torch.Generator().manual_seed(seed)
    acoustic = config.get("audio_acoustic_hidden_dim", 64)
    width = config.get("encoder_hidden_size") or config.get("hidden_size", 2048)
    inputs = dict(
        hidden_states=torch.randn(batch, image_tokens, acoustic, generator=generator),
        timestep=torch.randn(batch, generator=generator).abs(),
        timestep_r=torch.randn(batch, generator=generator).abs(),
        encoder_hidden_states=torch.randn(batch, text_tokens, width, generator=generator),
        context_latents=torch.randn(batch, image_tokens, 2 * acoustic, generator=generator),
    )
    return {k: v.to(device=device, dtype=dtype) for k, v in inputs.items()}


FAMILIES = (
    derived_family(
        "ace-step", AceStepTransformer1DModel, attention=(AceStepAttention,),
        variants={"1.5": {}},
        sources="diffusers 0.42.1 AceStepTransformer1DModel: its defaults are ACE-Step 1.5's (the class docstring; "
        "2048 wide, 24 blocks, 16 query and 8 key/value heads of 128, MLP 6144); the XL turbo's wider DiT is not "
        "listed",
        default_variant="1.5",
        example_inputs=ace_step_inputs,
        tests=Tests(
            # diffusers' AceStepTransformer1DModelTesterConfig with 8 query and 4 key/value heads (theirs: 4 and 2) so
            # that a mesh of 4 splits the key/value heads too, each still serving two query heads
            configs={"tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                                  num_key_value_heads=4, head_dim=8, in_channels=24, audio_acoustic_hidden_dim=8,
                                  patch_size=2, rope_theta=10000.0, rms_norm_eps=1e-6, sliding_window=16)},
        ),
    ),
)
