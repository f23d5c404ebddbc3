"""Small FLUX.2 configs, seeded models and comparison helpers shared by the tests."""

from __future__ import annotations

import copy

import torch
from diffusers import Flux2Transformer2DModel

from surgery_rewrites.flux2 import FAMILY, example_inputs, seeded_model
from surgery.testing import assert_unchanged, rel_err, snapshot  # noqa: F401  (re-exported for the tests)

SMALL_CONFIGS = FAMILY.test_configs


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
