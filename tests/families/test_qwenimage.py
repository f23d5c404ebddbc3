"""QwenImage and QwenImage-2.1: what the conformance suite cannot know.

Their plans are diffusers' own `_tp_plan` (same Linears, same styles; the suite checks outputs and collectives against
it), and the plan for diffusers' shared `Attention` class applies only to modules whose processor splits heads by
`head_dim` (others stay whole).
"""

from __future__ import annotations

import unittest

import torch
from diffusers.models.attention_processor import AttnProcessor2_0
from torch.distributed.device_mesh import init_device_mesh

import surgery
from surgery.parallel.distributed import fake_process_group
from surgery.core.build import model_on_meta
from surgery.integration.interop import diffusers_tp_plan
from surgery.testing import seeded_model


class QwenImagePlans(unittest.TestCase):
    def test_plans_cover_exactly_the_linears_of_diffusers_tp_plan(self):
        for name in ("qwen-image", "qwen-image-2.1"):
            family = surgery.extend.families()[name]
            for variant in family.variants:
                model = model_on_meta(family, family.config(variant))
                self.assertEqual(diffusers_tp_plan(model), type(model)._tp_plan, f"{name}-{variant}")

    def test_attention_with_a_processor_that_reshapes_by_global_heads_shards_after_unfuse(self):
        """A stock processor that reshapes by the stored head count is refused until `unfuse` gives it its head-dim
        twin (the processor rule); then that attention shards like the others."""
        from torch.distributed.tensor import DTensor

        family = surgery.extend.families()["qwen-image"]
        model = seeded_model(family, family.tests.configs["tp_small"])
        model.transformer_blocks[1].attn.set_processor(AttnProcessor2_0())
        with fake_process_group(2):
            mesh = init_device_mesh("cpu", (2,))
            with self.assertRaisesRegex(surgery.SurgeryError, "'transformer_blocks.1.attn' is still a fused"):
                surgery.tensor_parallel(model, mesh, src_data_rank=None)
            self.assertNotIsInstance(model.transformer_blocks[0].attn.to_q.weight, DTensor)  # nothing changed
            surgery.tensor_parallel(surgery.unfuse(model), mesh, src_data_rank=None)
        self.assertIsInstance(model.transformer_blocks[0].attn.to_q.weight, DTensor)
        self.assertIsInstance(model.transformer_blocks[1].attn.to_q.weight, DTensor)
        self.assertIsNot(type(model.transformer_blocks[1].attn.processor), AttnProcessor2_0)
        self.assertIsInstance(model.transformer_blocks[1].img_mlp.net[0].proj.weight, DTensor)

    def test_edit_2511_inputs_hold_a_target_and_a_condition_image(self):
        family = surgery.extend.families()["qwen-image"]
        config = family.tests.configs["edit2511_small"]
        kw = family.example_inputs(config, batch=2, image_tokens=16)
        self.assertEqual(kw["img_shapes"], [[(1, 2, 4), (1, 2, 4)]] * 2)
        with torch.no_grad():
            out = seeded_model(family, config)(**kw, return_dict=False)[0]
        self.assertEqual(out.shape, (2, 16, 16))
        self.assertTrue(torch.isfinite(out).all())


if __name__ == "__main__":
    unittest.main()
