"""HiDream's MoE feed-forwards sharded in training mode: what the conformance suite does not run (its models are in
eval mode, where diffusers' `moe_infer` runs the routed experts under no_grad and skips experts no token chose).

Each expert's `w2` is rowwise with its own all-reduce, so the routing weight multiplies a whole expert output: the
router (`MoEGate`, replicated) gets the single-device gradient on every rank. Sharded as a partial sum reduced once
per MoE instead, its gradient would be each rank's share of it.
"""

import unittest

import hidream_image_worker
from surgery.testing import run_on_cpu_ranks

import conformance_worker as W


class HiDreamMoE(unittest.TestCase):
    def test_training_mode_matches_stock_with_the_routers_gradient_whole(self):
        for rank, out in enumerate(run_on_cpu_ranks(hidream_image_worker.train_mode, 2)):
            self.assertLessEqual(out["forward"], W.FP32_TOL, f"rank {rank}")
            # per block: the shared expert and each of the 4 routed experts (training calls every one), plus the
            # attention's outputs and q/k norms across heads: double 2 + 4 + 1 + 4 + 1 (text FF), single 1 + 2 + 1 + 4
            self.assertEqual(out["expected_all_reduces"], 20)
            self.assertEqual(out["collectives"], {"all_reduce": 20}, f"rank {rank}")
            self.assertTrue(out["keys"])
            gates = {k: v for k, v in out["gradients"].items() if k.endswith("ff_i.gate.weight")}
            self.assertEqual(len(gates), 2)  # one router per block
            experts = [k for k in out["gradients"] if ".ff_i.experts." in k]
            self.assertEqual(len(experts), 2 * 4 * 3)  # every routed expert's w1, w2, w3 got its gradient
            for name, error in out["gradients"].items():
                self.assertLessEqual(error, W.FP32_GRAD_TOL, f"rank {rank}: {name}")


if __name__ == "__main__":
    unittest.main()
