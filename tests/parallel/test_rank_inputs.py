"""Inputs that every shape check passes but whose values differ by layout or by rank must shard exactly or be
refused on every rank (world 2, one spawned job for all cases)."""

import functools
import unittest

from surgery.testing import FP32_GRAD_TOL, FP32_TOL, run_on_cpu_ranks
from workers import rank_inputs_worker


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_on_cpu_ranks(rank_inputs_worker.run, 2)


class TransposedStorage(unittest.TestCase):
    """Every Linear's weight stored column-major: the same values, other strides. A shard received in place of a
    strided one was written in memory order (0.59 off with src_data_rank=0)."""

    def test_sharded_model_matches_the_single_device_one(self):
        for rank, r in enumerate(results()):
            for src in (0, None):
                with self.subTest(rank=rank, src_data_rank=src):
                    case = r[f"transposed_{src}"]
                    self.assertGreater(case["compared"], 20)
                    self.assertLess(case["forward"], FP32_TOL)
                    self.assertLess(case["grad"], FP32_GRAD_TOL)
