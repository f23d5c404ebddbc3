"""NucleusMoE-Image's routed experts: what the conformance suite (registration) does not say by itself.

The suite runs the experts' loop path sharded at worlds 2 and 4 against the single-device model, with its exact
all-reduce count (one per MoE layer: routed and shared experts summed once). These check the rest: the grouped-GEMM
path of the split experts against diffusers' own, that the split is along the experts' output columns (gate and up
halves of every expert, down rows alike), and that a mesh which cuts the experts' width unevenly is refused before
anything is sharded; and the published setting's grouped GEMMs sharded in bfloat16 (the only dtype torch 2.13's
`grouped_mm` propagates sharding for) against the loop path sharded alike (tests/workers/nucleusmoe_image_worker.py).
"""

from __future__ import annotations

import copy
import unittest

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import surgery
from surgery.core.build import model_on_meta
from surgery.parallel.distributed import fake_process_group
from surgery.parallel.plans import planned_for
from surgery.testing import FP32_TOL, rel_err


def _family():
    return surgery.extend.families()["nucleusmoe-image"]


def _seeded(config: dict) -> torch.nn.Module:
    from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoEImageTransformer2DModel

    torch.manual_seed(0)
    model = NucleusMoEImageTransformer2DModel(**config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 3:  # diffusers leaves the experts' tensors uninitialized (torch.empty)
                p.normal_(std=0.1)
    return model


class RoutedExperts(unittest.TestCase):
    def test_the_grouped_gemm_path_matches_diffusers(self):
        family = _family()
        config = dict(family.tests.configs["all_moe"], use_grouped_mm=True)
        stock = _seeded(config)
        model = surgery.unfuse(copy.deepcopy(stock))
        inputs = family.example_inputs(config, batch=2)
        self.assertLessEqual(rel_err(model(**inputs).sample, stock(**inputs).sample), FP32_TOL)

    def test_gate_and_up_are_the_halves_of_each_expert(self):
        stock = _seeded(_family().tests.configs["all_moe"])
        fused = stock.transformer_blocks[0].img_mlp.experts.gate_up_proj.detach().clone()
        experts = surgery.unfuse(stock).transformer_blocks[0].img_mlp.experts
        width = fused.shape[-1] // 2
        self.assertTrue(torch.equal(experts.gate_proj, fused[..., :width]))
        self.assertTrue(torch.equal(experts.up_proj, fused[..., width:]))
        self.assertEqual(experts.gate_proj.shape, experts.down_proj.shape[:1] + (fused.shape[1], width))

    def test_each_rank_holds_the_same_columns_of_gate_and_up_and_those_rows_of_down(self):
        family = _family()
        model = surgery.unfuse(model_on_meta(family, family.tests.configs["tiny"]))
        with fake_process_group(4):
            surgery.tensor_parallel(model, init_device_mesh("cpu", (4,)), src_data_rank=None)
        experts = model.transformer_blocks[1].img_mlp.experts
        self.assertEqual(experts.gate_proj.placements, (Shard(2),))
        self.assertEqual(experts.up_proj.placements, (Shard(2),))
        self.assertEqual(experts.down_proj.placements, (Shard(1),))
        self.assertEqual(experts.gate_proj.to_local().shape[-1], experts.down_proj.to_local().shape[1])
        self.assertEqual(experts.gate_proj.to_local().shape[-1] * 4, experts.gate_proj.shape[-1])

    def test_a_mesh_that_cuts_the_experts_unevenly_is_refused_first(self):
        family = _family()
        # 6 heads split over 3 ranks; the experts' 32 columns do not
        config = dict(family.tests.configs["all_moe"], num_attention_heads=6, attention_head_dim=8,
                      axes_dims_rope=(2, 2, 4), moe_intermediate_dim=32)
        model = surgery.unfuse(model_on_meta(family, config))
        before = {n: (type(p), tuple(p.shape)) for n, p in model.named_parameters()}
        self.assertTrue(planned_for(model))
        with fake_process_group(3), self.assertRaises(surgery.SurgeryError) as caught:
            surgery.tensor_parallel(model, init_device_mesh("cpu", (3,)))
        self.assertIn("transformer_blocks.0.img_mlp.experts.gate_proj' has 32 entries along dim 2", str(caught.exception))
        self.assertEqual({n: (type(p), tuple(p.shape)) for n, p in model.named_parameters()}, before)


class PublishedGroupedGemms(unittest.TestCase):
    def test_sharded_grouped_gemms_in_bf16_match_the_sharded_loop(self):
        from nucleusmoe_image_worker import grouped_bf16

        from surgery.testing import BF16_TOL, run_on_cpu_ranks

        for rank, r in enumerate(run_on_cpu_ranks(grouped_bf16, 2)):
            self.assertLessEqual(r["grouped_vs_loop"], BF16_TOL, f"rank {rank}")
            self.assertEqual(r["collectives"], {"all_reduce": r["expected_all_reduces"]}, f"rank {rank}")


if __name__ == "__main__":
    unittest.main()
