"""Kandinsky 5's attention names sharded: what the conformance suite (registration) does not say by itself: the
processor rule's edits of its reshapes by `num_heads`, the derived plan reading its names as their roles, and the
refusal of a stock processor reshaping by the stored head count.
"""

from __future__ import annotations

import inspect
import unittest

import torch
from torch.distributed.device_mesh import init_device_mesh

import surgery
from surgery.core import leaves
from surgery.core.build import model_on_meta
from surgery.parallel.distributed import fake_process_group


class Kandinsky5Names(unittest.TestCase):
    def test_the_rule_reads_the_reshape_by_num_heads_with_the_query_width(self):
        from diffusers.models.transformers.transformer_kandinsky import Kandinsky5AttnProcessor

        source = inspect.getsource(Kandinsky5AttnProcessor.__call__)
        # counted here from diffusers' source: q, k, v reshaped by the stored count in each of its two branches
        self.assertEqual(source.count("reshape(*shape, attn.num_heads, -1)")
                         + source.count("reshape(*cond_shape, attn.num_heads, -1)"), 6)
        edited = leaves.edited_source(Kandinsky5AttnProcessor)
        self.assertNotIn("attn.num_heads, -1)", edited)
        self.assertEqual(edited.count("-1, attn.to_query.out_features // attn.num_heads)"), 6)

    def test_the_derived_plan_reads_kandinsky5s_names_as_their_roles(self):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

        from surgery.parallel.derive import derived

        family = surgery.extend.families()["kandinsky5"]
        model = surgery.unfuse(model_on_meta(family, family.config()))
        block = model.visual_transformer_blocks[0]
        # diffusers' layout: to_query/to_key/to_value read the input, out_layer writes the output, query_norm and
        # key_norm normalize one head (64 = the rotary axes 16 + 24 + 24)
        for name in ("self_attention", "cross_attention"):
            attention = getattr(block, name)
            self.assertEqual(attention.query_norm.weight.shape[-1], 64)
            plan = derived(attention)
            self.assertEqual({k: type(v) for k, v in plan.items()},
                             {"to_query": ColwiseParallel, "to_key": ColwiseParallel, "to_value": ColwiseParallel,
                              "out_layer": RowwiseParallel, "query_norm": SequenceParallel,
                              "key_norm": SequenceParallel})

    def test_a_stock_processor_reshaping_by_num_heads_runs_on_dtensors(self):
        # Kandinsky 6 SR: the same attention spelling; with no rewrite to twin its processor (its family's taken away
        # here), its `unflatten(-1, (attn.num_heads, -1))` would cut each rank's heads into num_heads pieces on local
        # tensors, so it runs on DTensor q/k/v (global shapes) instead
        from unittest import mock

        from diffusers.models.transformers.transformer_kandinsky6_sr import (Kandinsky6SRAttention,
                                                                             Kandinsky6SRTransformer3DModel)

        from surgery.core import registry
        from surgery.parallel.derive import runs_on_dtensors

        others = [r for r in registry._registry if r.fused is not Kandinsky6SRAttention]
        with torch.device("meta"), mock.patch.object(registry, "_registry", others):
            model = Kandinsky6SRTransformer3DModel(in_visual_dim=4, out_visual_dim=4, time_dim=16, model_dim=32,
                                                   ff_dim=64, num_visual_blocks=1, axes_dims=(2, 2, 4))
        attentions = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
        self.assertTrue(attentions)
        self.assertTrue(all(runs_on_dtensors(m) for m in attentions))
        with fake_process_group(2), mock.patch.object(registry, "_registry", others):
            surgery.tensor_parallel(surgery.unfuse(model), init_device_mesh("cpu", (2,)), src_data_rank=None)
        self.assertTrue(all(runs_on_dtensors(m) for m in attentions))  # stock processors: nothing twinned them
        # Kandinsky 5's stock model (its family registered): refused as not yet unfused
        family = surgery.extend.families()["kandinsky5"]
        with fake_process_group(2):
            with self.assertRaisesRegex(surgery.SurgeryError, r"still a fused Kandinsky5Attention.*surgery\.unfuse"):
                surgery.tensor_parallel(model_on_meta(family, family.tests.configs["tiny"]),
                                        init_device_mesh("cpu", (2,)), src_data_rank=None)


if __name__ == "__main__":
    unittest.main()
