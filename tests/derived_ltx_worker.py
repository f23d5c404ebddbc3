"""World-N worker for tests/test_derived_ltx.py: LTX-Video and LTX-2 at two blocks, sharded, against the single-device
stock model, in float64 (at two blocks these seeded models' q/k gradients are too ill-conditioned for an fp32
comparison: rewrites/derived_ltx.py)."""

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

import conformance_worker as W
import surgery

CASES = (("ltx-video", "tiny_2_blocks"), ("ltx-2", "tiny_2.0_interleaved"))


def two_blocks(rank: int, world: int) -> dict:
    out = {}
    for family_name, config_name in CASES:
        family, config, fused = W.make(family_name, config_name, 0, torch.float64)
        kw = W.inputs(family, config, 0, torch.float64)
        model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), init_device_mesh("cpu", (world,)))
        result = {"expected_all_reduces": family.count_all_reduces(config)}
        with torch.no_grad():
            with W.CollectiveCounter() as counter:
                result["forward"] = W.rel_err(W.output(model, kw), W.output(fused, kw))
        result["collectives"] = dict(counter.counts)
        (ref_in, ref), (tp_in, tp) = W.gradients(fused, kw, 0), W.gradients(model, kw, 0)
        result["param_grads"] = max(W.gradient_errors(tp, ref).values())
        result["input_grads"] = max(W.rel_err(tp_in[k], g) for k, g in ref_in.items())
        out[f"{family_name}/{config_name}"] = result
    return out
