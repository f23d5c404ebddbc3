"""CogVideoX-5b (RoPE) sharded: what the conformance suite does not run (its sharded case is CogVideoX-2b's config).

Its processor rotates q/k in place (`query[:, :, text:] = apply_rotary_emb(...)`): at world 2, under no_grad (how
diffusers' pipelines run it) the sharded forward equals the single-device stock model with the derived all-reduces;
under autograd torch refuses the in-place write into the per-head norm's output (a view DTensor's to_local returns),
so training it sharded is not supported: this test says so, and fails once it runs.
"""

import unittest

import cogvideox_worker
from surgery.testing import run_on_cpu_ranks

import conformance_worker as W


class CogVideoXRope(unittest.TestCase):
    def test_sharded_forward_matches_stock_and_autograd_is_refused_by_torch(self):
        for rank, out in enumerate(run_on_cpu_ranks(cogvideox_worker.rope, 2)):
            self.assertLessEqual(out["forward"], W.FP32_TOL, f"rank {rank}")
            self.assertEqual(out["collectives"], {"all_reduce": out["expected_all_reduces"]}, f"rank {rank}")
            self.assertEqual(out["expected_all_reduces"], 4)  # 2 blocks: attention out + feed-forward out each
            self.assertIn("is a view and is being modified inplace", out["autograd"], f"rank {rank}")


if __name__ == "__main__":
    unittest.main()
