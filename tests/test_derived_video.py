"""What the conformance suite does not see of rewrites/derived_video.py: WanAnimate's face adapters (a cross attention
to the motion tokens injected between the blocks, outside the model's `_repeated_blocks`) are sharded like the blocks'
attentions, not left whole on every rank (the suite's all-reduce count would agree with either); Cosmos-2.5-Transfer's
image-context attention, which the family leaves out of its variants, is refused with its reason."""

from __future__ import annotations

import unittest

import diffusers
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import conformance_worker as W
import surgery
from surgery.parallel.distributed import fake_process_group
from surgery.testing import assert_unchanged, snapshot


class WanAnimateFaceAdapters(unittest.TestCase):
    def test_face_adapters_projections_are_sharded_by_heads(self):
        _, _, model = W.make("wan-animate", "tiny")
        surgery.unfuse(model)
        # the adapters' projections, read off the model: each Linear of an attention module (one with `heads`)
        adapters = [(path, m) for path, m in model.face_adapter.named_children()]
        self.assertEqual(len(adapters), 2)
        with fake_process_group(2):
            surgery.tensor_parallel(model, init_device_mesh("cpu", (2,)), src_data_rank=None)
        for path, adapter in adapters:
            self.assertIsInstance(adapter.heads, int)
            linears = {name: m for name, m in adapter.named_modules() if isinstance(m, nn.Linear)}
            self.assertEqual(sorted(linears), ["to_k", "to_out", "to_q", "to_v"], path)
            for name, linear in linears.items():
                weight = linear.weight
                self.assertIsInstance(weight, DTensor, f"face_adapter.{path}.{name}")
                # q/k/v by output rows (heads), the output projection by input columns (the same heads)
                self.assertEqual(weight.placements, (Shard(1 if name == "to_out" else 0),), f"{path}.{name}")
                self.assertEqual(weight.to_local().shape[weight.placements[0].dim] * 2,
                                 weight.shape[weight.placements[0].dim])


class CosmosImageContext(unittest.TestCase):
    def test_transfers_image_context_attention_is_refused_naming_its_processor(self):
        # Cosmos-2.5-Transfer (img_context_dim_in): its cross attention is a CosmosAttention run by
        # CosmosAttnProcessor2_5, which views the image q/k/v as `(batch, -1, attn.heads, dim_head)`
        torch.manual_seed(0)
        config = {**W.families()["cosmos"].test_configs["tiny"], "img_context_dim_in": 8, "img_context_dim_out": 16,
                  "img_context_num_tokens": 4}
        model = surgery.unfuse(diffusers.CosmosTransformer3DModel(**config))
        snap = snapshot(model)
        with fake_process_group(2), self.assertRaises(surgery.SurgeryError) as caught:
            surgery.tensor_parallel(model, init_device_mesh("cpu", (2,)), src_data_rank=None)
        message = str(caught.exception)
        self.assertIn("no plan derived for 'transformer_blocks.0.attn2': its processor CosmosAttnProcessor2_5 reads "
                      "the stored head count `attn.heads` beyond the reshapes the processor rule", message)
        self.assertNotIn("\n", message)
        assert_unchanged(model, snap)


if __name__ == "__main__":
    unittest.main()
