"""What the conformance suite does not see of Wan-Animate-2: its denoising pass, which reads the K/V cache the
reference pass filled (the suite runs the reference pass only: flex attention, which the denoising pass needs, has
no backward on CPU). Sharded, each rank caches and reads its own heads' K/V; both passes match the stock model with
the all-reduces the plan states."""

from __future__ import annotations

import unittest

import wan_animate_2_worker
from surgery.testing import run_on_cpu_ranks

import conformance_worker as W


class TwoPasses(unittest.TestCase):
    def test_reference_then_cached_pass_match_stock_and_each_rank_caches_its_heads(self):
        for rank, r in enumerate(run_on_cpu_ranks(wan_animate_2_worker.two_passes, 2)):
            where = f"rank {rank}"
            self.assertLessEqual(r["extract"], W.FP32_TOL, where)
            self.assertLessEqual(r["cached"], W.FP32_TOL, where)
            # per block: 2 output projections, 5 q/k norm statistics (self q, k; cross q, k, image k), 1 feed-forward
            self.assertEqual(r["expected_all_reduces"], 2 * 8)
            for kind in ("extract", "extract_calls", "cached_calls"):
                self.assertEqual(r["collectives"][kind], {"all_reduce": r["expected_all_reduces"]}, (kind, where))
            self.assertEqual(r["cache_shapes"], [(1, 32, 2, 32)] * 2, where)  # 4 heads of 32 over 2 ranks
            self.assertTrue(r["cache_is_this_ranks_heads"], where)


if __name__ == "__main__":
    unittest.main()
