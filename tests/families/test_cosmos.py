"""What the conformance suite does not see of Cosmos: Cosmos-2.5-Transfer's image-context attention, which the
family leaves out of its variants, runs its stock processor on DTensors."""

from __future__ import annotations

import unittest

import diffusers
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.device_mesh import init_device_mesh

import conformance_worker as W
import surgery
from surgery.parallel.distributed import fake_process_group


class CosmosImageContext(unittest.TestCase):
    def test_transfers_image_context_attention_runs_its_stock_processor_on_dtensors(self):
        # Cosmos-2.5-Transfer (img_context_dim_in): its cross attention is a CosmosAttention run by
        # CosmosAttnProcessor2_5, which views the image q/k/v as `(batch, -1, attn.heads, dim_head)`: no head-dim twin
        # fits, so the stock processor runs on DTensor q/k/v (surgery.parallel.dtensor_attention) with global shapes
        from surgery.parallel.derive import runs_on_dtensors

        torch.manual_seed(0)
        config = {**W.families()["cosmos"].tests.configs["tiny"], "img_context_dim_in": 8, "img_context_dim_out": 16,
                  "img_context_num_tokens": 4}
        model = surgery.unfuse(diffusers.CosmosTransformer3DModel(**config))
        attention = model.transformer_blocks[0].attn2
        self.assertTrue(runs_on_dtensors(attention))
        self.assertFalse(runs_on_dtensors(model.transformer_blocks[0].attn1))  # the twin path where it applies
        with fake_process_group(2):
            surgery.tensor_parallel(model, init_device_mesh("cpu", (2,)), src_data_rank=None)
        self.assertIsInstance(attention.to_q.weight, DTensor)
        self.assertEqual(attention.to_q.weight.to_local().shape[0] * 2, attention.to_q.weight.shape[0])

if __name__ == "__main__":
    unittest.main()
