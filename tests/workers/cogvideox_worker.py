"""World-2 worker for tests/families/test_cogvideox.py: CogVideoX-5b's RoPE config sharded, against the single-device
stock model."""

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

import conformance_worker as W
import surgery


def rope(rank: int, world: int) -> dict:
    family, config, fused = W.make("cogvideox", "tiny_rope", 0)
    kw = W.inputs(family, config, 0)
    out = {"expected_all_reduces": family.tp.all_reduces(config)}
    with torch.no_grad():
        expected = W.output(fused, kw)
        model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), init_device_mesh("cpu", (world,)))
        with W.CollectiveCounter() as counter:
            out["forward"] = W.rel_err(W.output(model, kw), expected)
        out["collectives"] = dict(counter.counts)
    try:  # under autograd the processor's in-place RoPE write into a to_local view is refused by torch
        W.output(model, kw)
        out["autograd"] = "ran"
    except RuntimeError as error:
        out["autograd"] = str(error).splitlines()[0]
    return out
