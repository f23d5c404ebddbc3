"""LTX-Video and LTX-2 sharded where the conformance suite does not run them: two blocks with attention biases (its
sharded configs hold one block, LTX-2's without biases: rewrites/derived_ltx.py says why), LTX-2.3's split RoPE
tables and LTX-2.0's interleaved ones, at world 2 against the single-device stock model, forward and gradients, with the derived all-reduces.

In float64: from the second block on, an fp32 gradient comparison measures these seeded models' conditioning, not the
sharding (a 1e-7 relative weight perturbation moves the stock model's own q/k gradients by up to 6e-5)."""

import unittest

import derived_ltx_worker
from surgery.testing import run_on_cpu_ranks

import conformance_worker as W


class TwoBlocks(unittest.TestCase):
    def test_ltx_video_and_ltx2_interleaved_match_stock_forward_and_backward(self):
        for rank, by_case in enumerate(run_on_cpu_ranks(derived_ltx_worker.two_blocks, 2)):
            self.assertEqual(sorted(by_case), sorted("/".join(c) for c in derived_ltx_worker.CASES))
            for key, r in by_case.items():
                where = f"{key}, rank {rank}"
                self.assertLessEqual(r["forward"], W.FP32_TOL, where)
                self.assertLessEqual(r["param_grads"], W.FP32_GRAD_TOL, where)
                self.assertLessEqual(r["input_grads"], W.FP32_GRAD_TOL, where)
                self.assertEqual(r["collectives"], {"all_reduce": r["expected_all_reduces"]}, where)
            # per block: LTX-Video 2 attentions x (2 norm statistics + output) + feed-forward; LTX-2 6 x 3 + 2
            self.assertEqual(by_case["ltx-video/tiny_2_blocks"]["expected_all_reduces"], 2 * 7)
            self.assertEqual(by_case["ltx-2/tiny_2.0_interleaved"]["expected_all_reduces"], 2 * 20)
            self.assertEqual(by_case["ltx-2/tiny_2.3"]["expected_all_reduces"], 2 * 20)


class SanaWMRefinerKVCache(unittest.TestCase):
    def test_cached_forwards_match_stock_with_each_rank_caching_its_heads(self):
        for rank, by_config in enumerate(run_on_cpu_ranks(derived_ltx_worker.refiner_kv_cache, 2)):
            self.assertEqual(sorted(by_config), ["tiny", "tiny_interleaved"])
            for name, r in by_config.items():
                self.assertLessEqual(r["first"], W.FP32_TOL, f"{name}, rank {rank}")
                self.assertLessEqual(r["second"], W.FP32_TOL, f"{name}, rank {rank}")
                self.assertEqual(r["collectives"], {"all_reduce": r["expected_all_reduces"]}, f"{name}, rank {rank}")
            # per block the video stream only: self-attention and prompt cross-attention (2 norm statistics and an
            # output each) and the feed-forward; LTX-2's audio stream, kept for the checkpoint, runs none
            self.assertEqual(by_config["tiny"]["expected_all_reduces"], 7)
            self.assertEqual(by_config["tiny_interleaved"]["expected_all_reduces"], 2 * 7)


if __name__ == "__main__":
    unittest.main()
