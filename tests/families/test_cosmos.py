"""What the conformance suite does not see of Cosmos: Cosmos-2.5-Transfer's image-context attention, which the
family leaves out of its variants, is refused with its reason."""

from __future__ import annotations

import unittest

import diffusers
import torch
from torch.distributed.device_mesh import init_device_mesh

import conformance_worker as W
import surgery
from surgery.parallel.distributed import fake_process_group
from surgery.testing import assert_unchanged, snapshot


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
