"""`OmniGenTransformer2DModel` (diffusers `transformer_omnigen.py`): the `omnigen` family (OmniGen v1, a Phi-3 decoder
over text tokens, the timestep token and image patches).

Derived (`surgery.extend.derived_family`): its processor reads the stored head count for more than a reshape (the head
size off the local query width, `attn.out_dim` to merge back), so it runs unmodified on DTensor q/k/v
(`surgery.parallel.dtensor_attention`). One rewrite no rule derives: the feed-forward's `gate_up_proj` holds the gate
and up rows fused (`chunk(2)` after it): two Linears behind the same call (a `rows` leaf), colwise, `down_proj`
rowwise.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_omnigen import OmniGenFeedForward, OmniGenTransformer2DModel

from surgery.extend import Tests, derived_family, rows, swap_rewrite

# The rotary scaling of OmniGen-v1 (Phi-3-mini-128k's "su" scaling), as diffusers' scripts/convert_omnigen_to_diffusers.py
# builds the published model with it
LONG_FACTOR = (
    1.0299999713897705, 1.0499999523162842, 1.0499999523162842, 1.0799999237060547, 1.2299998998641968,
    1.2299998998641968, 1.2999999523162842, 1.4499999284744263, 1.5999999046325684, 1.6499998569488525,
    1.8999998569488525, 2.859999895095825, 3.68999981880188, 5.419999599456787, 5.489999771118164,
    5.489999771118164, 9.09000015258789, 11.579999923706055, 15.65999984741211, 15.769999504089355,
    15.789999961853027, 18.360000610351562, 21.989999771118164, 23.079999923706055, 30.009998321533203,
    32.35000228881836, 32.590003967285156, 35.56000518798828, 39.95000457763672, 53.840003967285156,
    56.20000457763672, 57.95000457763672, 59.29000473022461, 59.77000427246094, 59.920005798339844,
    61.190006256103516, 61.96000671386719, 62.50000762939453, 63.3700065612793, 63.48000717163086,
    63.48000717163086, 63.66000747680664, 63.850006103515625, 64.08000946044922, 64.760009765625, 64.80001068115234,
    64.81001281738281, 64.81001281738281,
)
SHORT_FACTOR = (
    1.05, 1.05, 1.05, 1.1, 1.1, 1.1, 1.2500000000000002, 1.2500000000000002, 1.4000000000000004, 1.4500000000000004,
    1.5500000000000005, 1.8500000000000008, 1.9000000000000008, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.1000000000000005, 2.1000000000000005, 2.2, 2.3499999999999996,
    2.3499999999999996, 2.3499999999999996, 2.3499999999999996, 2.3999999999999995, 2.3999999999999995,
    2.6499999999999986, 2.6999999999999984, 2.8999999999999977, 2.9499999999999975, 3.049999999999997,
    3.049999999999997, 3.049999999999997,
)


def omnigen_inputs(config: dict, batch: int = 1, image_tokens: int = 16, text_tokens: int = 8, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Seeded keyword arguments for `OmniGenTransformer2DModel.forward`, as diffusers' OmniGen model test builds them:
    a square latent of `image_tokens` patches; a prompt of `text_tokens` ids followed by the placeholders of one input
    image (of the latent's size, in the first sample), whose patches replace their embeddings; a full attention mask
    and positions over the prompt, the timestep token and the output patches."""
    generator = torch.Generator().manual_seed(seed)
    patch = config.get("patch_size", 2)
    side = int(image_tokens ** 0.5) * patch
    channels = config.get("in_channels", 4)
    prompt = text_tokens + image_tokens
    tokens = prompt + 1 + image_tokens
    inputs = dict(
        hidden_states=torch.randn(batch, channels, side, side, generator=generator),
        timestep=torch.rand(batch, generator=generator),
        input_ids=torch.randint(0, 10, (batch, prompt), generator=generator),
        input_img_latents=[torch.randn(1, channels, side, side, generator=generator).to(device=device, dtype=dtype)],
        input_image_sizes={0: [[text_tokens, prompt]]},
        # 0/1 as integers: the model turns it into `(1 - mask) * min`, whose gradient is no input's to compare
        attention_mask=torch.ones(batch, tokens, tokens, dtype=torch.long),
        position_ids=torch.arange(tokens).repeat(batch, 1),
    )
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) if isinstance(v, torch.Tensor)
            else v for k, v in inputs.items()}


FEED_FORWARD = swap_rewrite("omnigen.feed_forward", OmniGenFeedForward, leaves=(
    rows("gate_up_proj", lambda ff: [("gate", ff.down_proj.in_features), ("up", ff.down_proj.in_features)]),))

FAMILY = derived_family(
    "omnigen", OmniGenTransformer2DModel, attention=(Attention,), rewrites=(FEED_FORWARD,),
    variants={"v1": dict(in_channels=4, patch_size=2, hidden_size=3072, rms_norm_eps=1e-5, num_attention_heads=32,
                         num_key_value_heads=32, intermediate_size=8192, num_layers=32, pad_token_id=32000,
                         vocab_size=32064, max_position_embeddings=131072, original_max_position_embeddings=4096,
                         rope_base=10000,
                         rope_scaling={"long_factor": list(LONG_FACTOR), "short_factor": list(SHORT_FACTOR),
                                       "type": "su"},
                         pos_embed_max_size=192, time_step_dim=256)},
    sources="Shitao/OmniGen-v1-diffusers as diffusers' scripts/convert_omnigen_to_diffusers.py builds it: "
    "OmniGenTransformer2DModel defaults (Phi-3-mini: 32 layers, 32 heads of 96, hidden 3072, MLP 8192, vocabulary "
    "32064) with its rope_scaling lists, patch 2, 4 latent channels, pos_embed_max_size 192; its config.json "
    "unverified here",
    default_variant="v1",
    example_inputs=omnigen_inputs,
    # diffusers' OmniGenTransformerTests config, with 2 layers (theirs: 20)
    tests=Tests(configs={"tiny": dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4,
                                      intermediate_size=32, num_layers=2, pad_token_id=0, vocab_size=1000,
                                      in_channels=4, time_step_dim=4,
                                      rope_scaling={"long_factor": [1, 2], "short_factor": [1, 2]})}),
)
