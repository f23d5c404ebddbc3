"""`tensor_parallel_pipeline` plans and checks every component before it shards the first (issue 41: a refused
transformer left the text encoder already sharded). Under torch's fake process group of 2 ranks, in one process."""

import unittest

import torch

from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import surgery
from pipeline_testing import TRANSFORMER, text_encoder, tokenizer, vae
from surgery.core.walk import find_modules
from surgery.parallel.distributed import fake_process_group
from surgery.testing import assert_unchanged, snapshot
from surgery_rewrites.flux2 import seeded_model


def tree(model) -> tuple[list, dict]:
    return [(n, type(m)) for n, m in model.named_modules()], {k: v.clone() for k, v in model.state_dict().items()}


def pipeline(heads: int) -> Flux2KleinPipeline:
    tok = tokenizer()
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift_terminal=None), vae=vae(0),
        text_encoder=text_encoder(len(tok), 0), tokenizer=tok,
        transformer=seeded_model(dict(TRANSFORMER, num_attention_heads=heads), 0))


class RefusedTransformer(unittest.TestCase):
    def test_nothing_is_sharded_or_left_unfused(self):
        pipe = pipeline(heads=3)  # 3 heads: a mesh of 2 cannot split them; the text encoder's 4 heads it can
        before = snapshot(pipe.text_encoder)
        stock = {name: tree(pipe.components[name]) for name in ("transformer", "vae")}
        with fake_process_group(2), self.assertRaisesRegex(
                surgery.SurgeryError, r"'transformer_blocks.0.attn.to_q' holds 3 heads of 16, which a mesh of 2 cannot split"):
            surgery.tensor_parallel_pipeline(pipe, init_device_mesh("cpu", (2,)))
        assert_unchanged(pipe.text_encoder, before)
        for name, (modules, values) in stock.items():  # unfused for the check, fused back: stock classes and values
            self.assertEqual(find_modules(pipe.components[name], fused=False), [], name)  # nothing left unfused
            now = tree(pipe.components[name])
            self.assertEqual(now[0], modules, name)
            self.assertEqual(list(now[1]), list(values), name)
            self.assertTrue(all(torch.equal(now[1][k], v) for k, v in values.items()), name)
        self.assertFalse(any(isinstance(p, DTensor) for p in pipe.text_encoder.parameters()))

    def test_a_shardable_pipeline_still_shards_every_component_it_can(self):
        pipe = pipeline(heads=4)
        with fake_process_group(2):
            report = surgery.tensor_parallel_pipeline(pipe, init_device_mesh("cpu", (2,)))
        self.assertEqual({r["component"]: r["sharded"] for r in report if r["sharded"]},
                         {"transformer": True, "text_encoder": True})
        self.assertTrue(any(isinstance(p, DTensor) for p in pipe.text_encoder.parameters()))
        self.assertTrue(any(isinstance(p, DTensor) for p in pipe.transformer.parameters()))


if __name__ == "__main__":
    unittest.main()
