"""`PriorTransformer` (diffusers `prior_transformer.py`): the `prior` family.

Derived (`surgery.extend.derived_family`): this file is data only (published configs with their source, test configs,
example inputs); plans, rewrites and all-reduce counts are derived (`surgery.parallel.derive`). The adaptive norms'
Linears stay whole by the general rule of `surgery.parallel.plans.replicated_reason`.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.prior_transformer import PriorTransformer

from surgery.extend import Tests, derived_family
from surgery_rewrites.diffusers_common import GENERIC, cast_inputs


def prior_inputs(config: dict, batch: int = 1, text_tokens: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", **_) -> dict:
    """Seeded keyword arguments for `PriorTransformer.forward` (an unCLIP prior: it denoises one CLIP image
    embedding, no image tokens): the noisy embedding, a timestep, the CLIP text embedding (`proj_embedding`), and
    where the config projects them (`encoder_hid_proj_type`), the text encoder's `num_embeddings` hidden states with
    their mask (the last two tokens padding: the causal mask plus padding path runs)."""
    generator = torch.Generator().manual_seed(seed)
    width = config.get("embedding_dim", 768)
    tokens = config.get("num_embeddings", 77)
    inputs = dict(
        hidden_states=torch.randn(batch, width, generator=generator),
        timestep=torch.rand(batch, generator=generator) * 1000,
        proj_embedding=torch.randn(batch, config.get("embedding_proj_dim") or width, generator=generator),
    )
    if config.get("encoder_hid_proj_type", "linear") is not None:
        inputs["encoder_hidden_states"] = torch.randn(batch, tokens, width, generator=generator)
    inputs = cast_inputs(inputs, dtype, device)
    if "encoder_hidden_states" in inputs:
        mask = torch.ones(batch, tokens, dtype=torch.bool)
        mask[:, -2:] = False
        inputs["attention_mask"] = mask.to(device)
    return inputs


_SHAP_E = dict(num_layers=24, embedding_dim=1024, num_embeddings=1024, additional_embeddings=0,
               time_embed_act_fn="gelu", norm_in_type="layer", encoder_hid_proj_type=None, added_emb_type=None,
               time_embed_dim=4096, clip_embed_dim=2048)


FAMILY = derived_family(
    "prior", PriorTransformer, attention=(Attention,), processors=GENERIC,
    variants={
        "kandinsky-2.2": {},
        "shap-e": {**_SHAP_E, "num_attention_heads": 16, "attention_head_dim": 64, "embedding_proj_dim": 768},
        "shap-e-img2img": {**_SHAP_E, "num_attention_heads": 8, "attention_head_dim": 128,
                           "embedding_proj_dim": 1024, "embedding_proj_norm_type": "layer"},
    },
    sources="diffusers scripts/convert_kandinsky_to_diffusers.py (PRIOR_CONFIG: the class defaults, 20 layers of "
    "32 heads of 64 over CLIP ViT-L's 768: kandinsky-community/kandinsky-2-1-prior and -2-2-prior) and "
    "scripts/convert_shap_e_to_diffusers.py (PRIOR_CONFIG, PRIOR_IMAGE_CONFIG: openai/shap-e, shap-e-img2img)",
    default_variant="kandinsky-2.2",
    example_inputs=prior_inputs,
    tests=Tests(configs={"tiny": dict(num_attention_heads=4, attention_head_dim=8, num_layers=2, embedding_dim=32,
                                      num_embeddings=7, additional_embeddings=4)}),
)
