"""DreamLite as its pipelines run it: the conformance suite shards a `DreamLiteTransformer2DModel` built alone (with
the processor the UNet sets, `Family.processor`); here each transformer of DreamLite's UNet (diffusers' pipeline tests'
config: 8 query heads over one key/value head, blocks with and without self-attention) is unfused and sharded where it
sits, at world 2, and the UNet's output equals the single-device stock UNet's with the transformers' derived
all-reduces and nothing else."""

import unittest

import torch
from torch.distributed.device_mesh import init_device_mesh

import dreamlite_worker
import surgery
from surgery.core.build import seeded_model
from surgery.parallel.distributed import fake_process_group
from surgery.testing import run_on_cpu_ranks

import conformance_worker as W


class DreamLiteUNet(unittest.TestCase):
    def test_each_transformer_sharded_in_the_unet_matches_the_stock_unet(self):
        for rank, out in enumerate(run_on_cpu_ranks(dreamlite_worker.sharded_transformers, 2)):
            # down 2 without self-attention + 1, mid 1, up 2 + 2 without self-attention (layers + 1 each)
            self.assertEqual(out["transformers"], 8)
            self.assertLessEqual(out["forward"], W.FP32_TOL, f"rank {rank}")
            self.assertEqual(out["collectives"], {"all_reduce": out["expected_all_reduces"]}, f"rank {rank}")
            self.assertEqual(out["expected_all_reduces"], 4 * 2 + 4 * 3)  # (attn2, ff) / (attn1, attn2, ff) outputs


class ZeroHeads(unittest.TestCase):
    def test_padding_is_refused_where_the_key_value_head_stays_whole(self):
        # a zero query head would attend to the shared key/value head: its output is not zero, so the output
        # projection's zero columns get gradients (measured before this refusal: 258 after one backward, 2.6 after
        # one AdamW step); the model is left as it was
        family = W.families()["dreamlite"]
        model = surgery.unfuse(seeded_model(family, family.tests.configs["tiny"]))
        before = {n: p.clone() for n, p in model.state_dict().items()}
        with fake_process_group(3), self.assertRaisesRegex(
                surgery.SurgeryError, r"'transformer_blocks.0.attn1' has 8 query heads over one key/value head"):
            surgery.tensor_parallel(model, init_device_mesh("cpu", (3,)), pad_heads=True)
        self.assertTrue(all(torch.equal(p, before[n]) for n, p in model.state_dict().items()))


if __name__ == "__main__":
    unittest.main()
