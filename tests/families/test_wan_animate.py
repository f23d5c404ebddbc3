"""What the conformance suite does not see of Wan-Animate: its face adapters (a cross attention to the motion tokens
injected between the blocks, outside the model's `_repeated_blocks`) are sharded like the blocks' attentions, not
left whole on every rank (the suite's all-reduce count would agree with either)."""

from __future__ import annotations

import unittest

import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import conformance_worker as W
import surgery
from surgery.parallel.distributed import fake_process_group


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


if __name__ == "__main__":
    unittest.main()
