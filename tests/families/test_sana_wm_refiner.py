"""SANA-WM's LTX-2 refiner sharded where the conformance suite does not run it: its cached forwards (the KV cache
its sampler keeps), each rank caching its own heads, at world 2 against the single-device stock model."""

from __future__ import annotations

import unittest

import ltx_worker
from surgery.testing import run_on_cpu_ranks

import conformance_worker as W


class SanaWMRefinerKVCache(unittest.TestCase):
    def test_cached_forwards_match_stock_with_each_rank_caching_its_heads(self):
        for rank, by_config in enumerate(run_on_cpu_ranks(ltx_worker.refiner_kv_cache, 2)):
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
