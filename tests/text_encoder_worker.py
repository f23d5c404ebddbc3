"""What each gloo rank runs for the text-encoder tests: every family's encoder sharded, against one device."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import surgery
import text_encoder_testing as E
from surgery.verify import rel_err


def _sharded(encoder) -> list[str]:
    return sorted({n for n, p in encoder.named_parameters() if isinstance(p, DTensor) and p.placements[0].is_shard()})


def run(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    tokens, mask = E.ids()
    for name, (build, _) in E.ENCODERS.items():
        encoder = build(0)
        expected = E.outputs(encoder, tokens, mask)
        surgery.tensor_parallel(encoder, mesh)
        got = E.outputs(encoder, tokens, mask)
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in encoder.parameters())
        out[name] = {
            "error": max(rel_err(g, e) for g, e in zip(got, expected)),
            "outputs": len(expected),
            "sharded": _sharded(encoder),
            "local_fraction": local / sum(p.numel() for p in build(0).parameters()),
        }
    for name, build, kwargs in (("mistral3_kv", E.mistral3, dict(num_key_value_heads=1)),
                                ("t5_heads", E.t5, dict(num_heads=3))):
        try:
            surgery.tensor_parallel(build(0, **kwargs), mesh)
            out[f"refusal_{name}"] = None
        except surgery.SurgeryError as error:
            out[f"refusal_{name}"] = str(error)
    return out
