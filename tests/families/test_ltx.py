"""LTX-Video and LTX-2 sharded where the conformance suite does not run them (one job for both): two blocks with
attention biases (its sharded configs hold one block, LTX-2's without biases: rewrites/ltx.py and rewrites/ltx2.py
say why), LTX-2.3's split RoPE tables and LTX-2.0's interleaved ones, at world 2 against the single-device stock
model, forward and gradients, with the derived all-reduces.

In float64: from the second block on, an fp32 gradient comparison measures these seeded models' conditioning, not the
sharding (a 1e-7 relative weight perturbation moves the stock model's own q/k gradients by up to 6e-5)."""

import unittest

import ltx_worker
from surgery.testing import run_on_cpu_ranks

import conformance_worker as W


class TwoBlocks(unittest.TestCase):
    def test_ltx_video_and_ltx2_interleaved_match_stock_forward_and_backward(self):
        for rank, by_case in enumerate(run_on_cpu_ranks(ltx_worker.two_blocks, 2)):
            self.assertEqual(sorted(by_case), sorted("/".join(c) for c in ltx_worker.CASES))
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


if __name__ == "__main__":
    unittest.main()
