"""diffusers' features on the unfused model sharded with `surgery.tensor_parallel`, on each gloo rank: the stock
(fused, single-device) model with the same feature is the reference. A feature stock refuses is reported as such."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

import conformance_worker as W
import surgery
from surgery.testing import rel_err


def _steps(family, config, n=4):
    kw = W.inputs(family, config, 0)
    noise = torch.randn(kw["hidden_states"].shape, generator=torch.Generator().manual_seed(7))
    for i in range(n):
        step = dict(kw)
        step["hidden_states"] = kw["hidden_states"] + 0.05 * i * noise
        if isinstance(kw.get("timestep"), torch.Tensor):
            step["timestep"] = kw["timestep"] * (1.0 - 0.15 * i)
        yield step


def _apply(model, feature):
    from diffusers.hooks import (FirstBlockCacheConfig, LayerSkipConfig, MagCacheConfig, TaylorSeerCacheConfig,
                                 apply_layer_skip)

    if feature == "first_block":
        model.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    elif feature == "taylorseer":
        model.enable_cache(TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=1, max_order=1,
                                                 taylor_factors_dtype=torch.float32))
    elif feature == "mag":
        model.enable_cache(MagCacheConfig(num_inference_steps=4, retention_ratio=0.0, threshold=100.0,
                                          mag_ratios=[1.0] * 4))
    elif feature == "layer_skip":
        for fqn in ("transformer_blocks", "single_transformer_blocks"):
            if hasattr(model, fqn):
                apply_layer_skip(model, LayerSkipConfig(indices=[0], fqn=fqn))
    elif feature == "regional_compile":
        torch._dynamo.reset()
        model.compile_repeated_blocks(backend="eager")
    else:
        raise ValueError(feature)


def _outputs(model, family, config, feature):
    outs = []
    with torch.no_grad():
        for kw in _steps(family, config, 2 if feature == "regional_compile" else 4):
            if feature in ("first_block", "taylorseer", "mag"):
                with model.cache_context("cond"):
                    outs.append(W.output(model, kw))
            else:
                outs.append(W.output(model, kw))
    return outs


def run(rank: int, world: int, cases: list[tuple[str, str, list[str]]]) -> dict:
    """`cases`: (family, test config, features); results by `family/feature`."""
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for family_name, config_name, features in cases:
        for feature in features:
            family, config, fused = W.make(family_name, config_name, 0)
            key = f"{family_name}/{feature}"
            try:
                _apply(fused, feature)
                expected = _outputs(fused, family, config, feature)
            except Exception as error:  # noqa: BLE001 - stock's refusal is the reason to skip
                out[key] = {"stock_refuses": f"{type(error).__name__}: {str(error)[:160]}"}
                continue
            model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(W.make(family_name, config_name, 0)[2])),
                                            mesh)
            try:
                _apply(model, feature)
                got = _outputs(model, family, config, feature)
                out[key] = {"errors": [rel_err(g, e) for g, e in zip(got, expected)]}
            except Exception as error:  # noqa: BLE001 - reported to the test, which fails with it
                out[key] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    return out
