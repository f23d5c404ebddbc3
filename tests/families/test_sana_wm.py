"""SANA-WM (rewrites/sana_wm.py): what the conformance suite cannot know.

Its softmax blocks run attention in bfloat16 even in a float32 model, so the suite holds its gradients to bfloat16's
bound. Here a model of gated-delta blocks only (all float32) is held to float32's: forward, every parameter's gradient
and the inputs' (the camera conditions' too, whose UCPE ray transforms each rank uses for its own heads), at world 2
against the single-device stock model, with exactly the declared all-reduces.
"""

from __future__ import annotations

import unittest

import conformance_worker as W
from surgery.testing import FP32_GRAD_TOL, FP32_TOL, run_on_cpu_ranks


class GatedDeltaBlocksInFloat32(unittest.TestCase):
    def test_world_2_matches_one_device_within_float32_bounds(self):
        seed = W.case_seed("sana-wm", "gdn_tiny")
        for rank, r in enumerate(run_on_cpu_ranks(W.tp_case, 2, "sana-wm", "gdn_tiny", seed)):
            self.assertLessEqual(r["forward"], FP32_TOL, f"rank {rank}")
            self.assertTrue(r["grad_keys_match"])
            self.assertLessEqual(r["param_grads"], FP32_GRAD_TOL, f"rank {rank}")
            self.assertLessEqual(r["input_grads"], FP32_GRAD_TOL, f"rank {rank}")
            self.assertEqual(r["collectives"], {"all_reduce": r["expected_all_reduces"]})
            self.assertEqual(r["expected_all_reduces"], 18)  # per block: 6 norms across heads, 3 rowwise outputs
