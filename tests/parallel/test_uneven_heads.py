"""Heads a mesh does not divide: `tensor_parallel(..., pad_heads=True)` against the single-device model (gloo).

World 3 (FLUX.2 with 4 heads, SD3.5 with 4 heads, an adapter) runs in the default tier; worlds 4 and 5 (FLUX.2 with
6 heads) in the heavy tier.
"""

import functools
import os
import sys
import tempfile
import unittest

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "workers"))

import uneven_heads_worker  # noqa: E402
from surgery.testing import FP32_GRAD_TOL, FP32_TOL, run_on_cpu_ranks  # noqa: E402


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        return run_on_cpu_ranks(uneven_heads_worker.run, world, folder)


class World3(unittest.TestCase):
    world = 3

    def cases(self):
        for rank, result in enumerate(results(self.world)):
            for name, _ in uneven_heads_worker.CASES[self.world]:
                yield f"rank {rank} {name}", rank, result[name]

    def test_refused_by_default_naming_the_option_model_untouched(self):
        for where, _, r in self.cases():
            self.assertIn("cannot split evenly", r["refusal"] or "", where)
            self.assertIn("pad_heads=True", r["refusal"], where)
            self.assertTrue(r["unchanged_after_refusal"], where)

    def test_padded_to_a_multiple_of_the_mesh(self):
        for where, _, r in self.cases():
            heads = r["heads"]
            self.assertEqual(r["padded_heads"], [(heads, -(-heads // self.world) * self.world)], where)
            self.assertGreater(r["padded_tensors"], 0, where)

    def test_forward_and_all_reduces(self):
        for where, _, r in self.cases():
            self.assertLessEqual(r["forward"], FP32_TOL, where)
            self.assertEqual(set(r["collectives"]), {"all_reduce"}, where)
            self.assertEqual(r["collectives"], r["even_collectives"], where)

    def test_backward_and_zero_heads_stay_zero(self):
        for where, _, r in self.cases():
            self.assertLessEqual(r["grad_input"], FP32_GRAD_TOL, where)
            self.assertLessEqual(r["grad_params"], FP32_GRAD_TOL, where)
            self.assertEqual(r["padded_grad_max"], 0.0, where)
            self.assertEqual(r["padded_after_step_max"], 0.0, where)

    def test_saved_checkpoint_is_the_original_bitwise(self):
        for where, rank, r in self.cases():
            if rank == 0:
                self.assertTrue(r["saved_keys_equal"], where)
                self.assertEqual(r["saved_mismatch"], [], where)


class World3Adapter(unittest.TestCase):
    def test_adapter_zero_on_zero_heads_saved_stock_and_loaded_back(self):
        for rank, result in enumerate(results(3)):
            r = result["lora"]
            self.assertEqual(r["after_shard_lora"], 0.0, f"rank {rank}")
            self.assertEqual(r["after_step"], 0.0, f"rank {rank}")
            self.assertLessEqual(r["saved -> stock"], FP32_TOL, f"rank {rank}")
            self.assertLessEqual(r["stock -> padded load"], FP32_TOL, f"rank {rank}")


@pytest.mark.heavy
class World4(World3):
    world = 4


@pytest.mark.heavy
class World5(World3):
    world = 5
