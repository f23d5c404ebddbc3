"""HunyuanImage's token refiner: its `Attention` runs diffusers' generic processor, is not this family's and is left
as is; the refiner's feed-forward is sharded by the shared `FeedForward` plan. The conformance configs have no refiner
blocks because its key bias gets an analytically zero gradient (softmax is invariant to a per-query constant, and the
refiner has no QK-norm): fp32 noise of ~1e-7, relative to which any two correct runs differ by O(1). Here the refiner
runs, and gradients are compared on each module's gradient scale, as the conformance suite compares them."""

from __future__ import annotations

import copy
import unittest

import torch
from torch.distributed.device_mesh import init_device_mesh

import conformance_worker as W
import surgery
from surgery.core.registry import families
from surgery.testing import CollectiveCounter, rel_err, run_on_cpu_ranks, seeded_model
from surgery.core.walk import find_modules

CONFIG = dict(families()["hunyuan-image"].tests.configs["tp_wide"], num_refiner_layers=1)
REFINER = "context_embedder.token_refiner.refiner_blocks.0"


def grad_errors(ref: dict, got: dict) -> dict:
    """Per-parameter max |got - ref| over the largest reference gradient of its module, as the conformance suite
    measures (`conformance_worker.gradient_errors`). A tensor's own scale is not a fair one: the refiner's key bias
    has an analytically zero gradient, and others are small where their module's are not, so fp32 rounding (which
    depends on the thread count's reduction order) was measured against a near-zero reference (1.14e-5 on a fresh
    machine with its own scale floored at 1e-3 of the model's largest gradient)."""
    return W.gradient_errors(got, ref)


def sharded_case(rank: int, world: int) -> dict:
    family = families()["hunyuan-image"]
    fused = seeded_model(family, CONFIG, seed=3)
    kw = W.inputs(family, CONFIG, seed=3)
    model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), init_device_mesh("cpu", (world,)))
    with torch.no_grad(), CollectiveCounter() as counter:
        forward = rel_err(W.output(model, kw), W.output(fused, kw))
    (_, ref), (_, tp) = W.gradients(fused, kw, 3), W.gradients(model, kw, 3)
    tp = surgery.state_dict.fuse_state_dict(tp, surgery.state_dict.weight_slices(model))
    return {"forward": forward, "collectives": dict(counter.counts), "grads": max(grad_errors(ref, tp).values())}


class TokenRefiner(unittest.TestCase):
    def test_refiner_attention_is_left_stock_and_the_model_stays_equivalent(self):
        fused = seeded_model(families()["hunyuan-image"], CONFIG, seed=1)
        unfused = surgery.unfuse(copy.deepcopy(fused))
        self.assertIs(type(unfused.get_submodule(f"{REFINER}.attn")), type(fused.get_submodule(f"{REFINER}.attn")))
        self.assertEqual(find_modules(unfused, fused=True), [])
        kw = W.inputs(families()["hunyuan-image"], CONFIG, seed=1)
        with torch.no_grad():
            self.assertLessEqual(rel_err(W.output(unfused, kw), W.output(fused, kw)), W.FP32_TOL)
        (_, ref), (_, got) = W.gradients(fused, kw, 1), W.gradients(unfused, kw, 1)
        got = surgery.state_dict.fuse_state_dict(got, surgery.state_dict.weight_slices(unfused))
        self.assertLessEqual(max(grad_errors(ref, got).values()), W.FP32_GRAD_TOL)

    def test_sharded_with_refiner_matches_single_device_fused_model(self):
        for r in run_on_cpu_ranks(sharded_case, 2):
            self.assertLessEqual(r["forward"], W.FP32_TOL)
            self.assertLessEqual(r["grads"], W.FP32_GRAD_TOL)
            self.assertEqual(r["collectives"], {"all_reduce": families()["hunyuan-image"].tp.all_reduces(CONFIG)})
