"""What each gloo rank runs for the context-parallel input tests (world 2): a mesh without dimension names, and a
sequence the ranks cannot split evenly. Each case records the error each rank raised."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

import surgery
from flux2_testing import build, inputs, rel_err, small_config


def _error(call) -> str | None:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the type is part of what the test checks
        return f"{type(e).__name__}: {e}"
    return None


def cp_inputs(config, image_tokens):
    kw = inputs(config, 0, image_tokens=image_tokens, text_tokens=8)
    kw["img_ids"], kw["txt_ids"] = kw["img_ids"].unsqueeze(0), kw["txt_ids"].unsqueeze(0)
    return kw


def run(rank: int, world: int) -> dict:
    config = small_config("tp_wide")
    out = {"unnamed": _error(lambda: surgery.context_parallel(build(config), init_device_mesh("cpu", (world,))))}
    fused = build(config)
    model = surgery.context_parallel(build(config), init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
    with torch.no_grad():
        out["odd_tokens"] = _error(lambda: model(**cp_inputs(config, 7), return_dict=False))
        kw = cp_inputs(config, 8)
        out["even_tokens"] = rel_err(model(**kw, return_dict=False)[0], fused(**kw, return_dict=False)[0])
    return out
