"""Small FLUX.2 configs, seeded models and comparison helpers shared by the tests."""

from __future__ import annotations

import copy

import torch
from diffusers import Flux2Transformer2DModel

from rewrites.flux2 import example_inputs, seeded_model
from surgery.verify import rel_err  # noqa: F401  (re-exported for the tests)

# Small-width configs shaped like the real ones (depth and head-count ratios), plus awkward shapes.
SMALL_CONFIGS = {
    # klein-4B: 5 double / 20 single, 24 heads -> 1 / 4, 3 heads
    "klein4b_small": dict(num_layers=1, num_single_layers=4, num_attention_heads=3, attention_head_dim=16,
                          joint_attention_dim=32, guidance_embeds=False),
    # klein-9B: 8 / 24, 32 heads -> 1 / 3, 4 heads
    "klein9b_small": dict(num_layers=1, num_single_layers=3, num_attention_heads=4, attention_head_dim=16,
                          joint_attention_dim=48, guidance_embeds=False),
    # dev: 8 / 48, 48 heads, guidance -> 1 / 6, 6 heads
    "dev_small": dict(num_layers=1, num_single_layers=6, num_attention_heads=6, attention_head_dim=8,
                      joint_attention_dim=40, guidance_embeds=True),
    "odd_heads": dict(num_layers=2, num_single_layers=2, num_attention_heads=5, attention_head_dim=12,
                      joint_attention_dim=24, mlp_ratio=2.5, guidance_embeds=True),
    # int(56 * 3.3) = 184: fractional mlp_ratio
    "fractional_mlp": dict(num_layers=1, num_single_layers=2, num_attention_heads=7, attention_head_dim=8,
                           joint_attention_dim=16, mlp_ratio=3.3, guidance_embeds=False),
    # 8 heads and int(64 * 2.5) = 160 hidden units split evenly over 2 and 4 ranks
    "tp_wide": dict(num_layers=2, num_single_layers=2, num_attention_heads=8, attention_head_dim=8,
                    joint_attention_dim=24, mlp_ratio=2.5, guidance_embeds=True),
}

_ROPE = {8: (2, 2, 2, 2), 12: (2, 2, 4, 4), 16: (4, 4, 4, 4)}


def small_config(name: str) -> dict:
    config = dict(SMALL_CONFIGS[name])
    config.update(in_channels=16, timestep_guidance_channels=32, axes_dims_rope=_ROPE[config["attention_head_dim"]])
    return config


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


def snapshot(model: torch.nn.Module) -> tuple:
    """Everything an atomic failure must leave unchanged: module objects, classes, parameter objects and values."""
    modules = [(name, id(m), type(m)) for name, m in model.named_modules()]
    params = {name: (id(p), p.detach().clone()) for name, p in model.named_parameters()}
    return modules, params


def assert_unchanged(model: torch.nn.Module, snap: tuple) -> None:
    modules, params = snap
    assert [(name, id(m), type(m)) for name, m in model.named_modules()] == modules
    now = dict(model.named_parameters())
    assert now.keys() == params.keys()
    for name, (pid, value) in params.items():
        assert id(now[name]) == pid, name
        assert torch.equal(now[name].detach(), value), name
