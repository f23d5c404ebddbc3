"""What each gloo rank runs for tests/families/test_nucleusmoe_image.py: the published setting's grouped GEMMs
(`use_grouped_mm=True`) sharded, against the experts' loop path sharded alike.

torch 2.13's `grouped_mm` takes float32 on the CPU kernel, but its meta function (which DTensor's sharding
propagation runs) insists on bfloat16 and 16-byte strides, as the CUDA kernel does: so the sharded grouped path runs
in bfloat16 only, with widths whose shards keep 16-byte strides. In bfloat16 this model's expert-choice routing
picks other tokens than in float32 (whole or sharded alike: 0.38 apart on these inputs), so the grouped path is held
to the loop path, each sharded, in bfloat16; the loop path sharded is held to the single-device model in float32 by
the conformance suite.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

import surgery
from surgery.core.build import seeded_model
from surgery.core.registry import families
from surgery.testing import CollectiveCounter, rel_err


def grouped_bf16(rank: int, world: int) -> dict:
    family = families()["nucleusmoe-image"]
    # the suite's sharded config; 64-wide experts (32 per rank at world 2: 64-byte strides)
    config = dict(family.tests.configs["tiny"], moe_intermediate_dim=64)
    stock = seeded_model(family, config, seed=0).to(torch.bfloat16)
    inputs = family.example_inputs(config, batch=2, dtype=torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    outputs, counts = {}, {}
    with torch.no_grad():
        for grouped in (False, True):
            model = surgery.unfuse(copy.deepcopy(stock))
            for block in model.transformer_blocks:
                if block.moe_enabled:
                    block.img_mlp.experts.use_grouped_mm = grouped
            surgery.tensor_parallel(model, mesh)
            with CollectiveCounter() as counted:
                outputs[grouped] = model(**inputs).sample.float()
            counts[grouped] = dict(counted.counts)
    return {"grouped_vs_loop": rel_err(outputs[True], outputs[False]), "collectives": counts[True],
            "expected_all_reduces": family.tp.all_reduces(config)}
