"""World-2 worker for tests/families/test_hidream_image.py: HiDream's MoE sharded in training mode (every expert runs, the
router's gradient flows), against the single-device stock model."""

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

import conformance_worker as W
import surgery


def train_mode(rank: int, world: int) -> dict:
    family, config, fused = W.make("hidream", "tiny_routed", 0)
    fused.train()  # MOEFeedForwardSwiGLU's training path: every expert called, routing weights under autograd
    kw = W.inputs(family, config, 0)
    model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), init_device_mesh("cpu", (world,)))
    out = {"expected_all_reduces": family.tp.all_reduces(config)}
    with torch.no_grad():
        expected = W.output(fused, kw)
        with W.CollectiveCounter() as counter:
            out["forward"] = W.rel_err(W.output(model, kw), expected)
        out["collectives"] = dict(counter.counts)
    (_, ref), (_, got) = W.gradients(fused, kw, 0), W.gradients(model, kw, 0)
    out["keys"] = sorted(ref) == sorted(got)
    out["gradients"] = W.gradient_errors(got, ref)
    return out
