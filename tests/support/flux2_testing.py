"""Small FLUX.2 configs, seeded models and comparison helpers shared by the tests."""

from __future__ import annotations

import copy

import torch
from diffusers import Flux2Transformer2DModel
from diffusers.models.transformers.transformer_flux2 import Flux2KVAttnProcessor, Flux2KVParallelSelfAttnProcessor

from surgery_rewrites.flux2 import FAMILY, example_inputs, seeded_model
from surgery.testing import assert_unchanged, rel_err, snapshot  # noqa: F401  (re-exported for the tests)

SMALL_CONFIGS = FAMILY.tests.configs


def small_config(name: str) -> dict:
    return dict(SMALL_CONFIGS[name])


def build(config: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> Flux2Transformer2DModel:
    """A seeded Flux2 model with every weight random (RMSNorm scales too), in eval mode."""
    return seeded_model(config, seed, dtype)


def inputs(config: dict, seed: int = 0, batch: int = 2, dtype: torch.dtype = torch.float32, **kw) -> dict:
    return example_inputs(config, batch=batch, image_tokens=kw.pop("image_tokens", 10),
                          text_tokens=kw.pop("text_tokens", 6), seed=seed, dtype=dtype, **kw)


def fused_and_copy(config: dict, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A fused model and an independent deep copy (which the caller may unfuse)."""
    model = build(config, seed, dtype)
    return model, copy.deepcopy(model)


def use_kv_processors(model):
    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())


def forward(model, kw):
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]


# the fused FLUX.2 Linears a stock LoRA targets
STOCK_TARGETS = (r".*(to_[qkv]|to_out\.0|add_[qkv]_proj|to_add_out|to_qkv_mlp_proj|"
                 r"single_transformer_blocks\.\d+\.attn\.to_out|linear_in|linear_out)$")


def add_random_adapter(model, name: str, seed: int, targets=STOCK_TARGETS, rank: int = 4, alpha: int = 8, **kw):
    """A PEFT adapter with random (not zero) factors, as after training; alpha != rank so that scales matter."""
    from peft import LoraConfig

    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, **kw), adapter_name=name)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if f".{name}." in param_name and "lora_" in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model
