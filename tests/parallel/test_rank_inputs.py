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


class FilterKeepsHeadNormsWhole(unittest.TestCase):
    """A q/k norm kept whole while its projections are sharded runs on each rank's heads: a right forward, and a
    weight gradient of those heads alone (0.98 off before it was refused)."""

    def test_refused_on_every_rank_naming_the_norm_and_the_model_kept(self):
        errors = [r["norms_whole"]["error"] for r in results()]
        self.assertRegex(errors[0] or "", r"filter_fn keeps 'transformer_blocks.0.attn.norm_q' whole but shards "
                                          r"'transformer_blocks.0.attn.to_q', whose heads it normalizes")
        self.assertEqual(errors[1], errors[0])

    def test_attention_kept_whole_with_its_norms_shards_and_trains_right(self):
        for rank, r in enumerate(results()):
            with self.subTest(rank=rank):
                self.assertIsNone(r["attention_whole"]["error"])
                self.assertLess(r["attention_whole"]["grad"], FP32_GRAD_TOL)


class WrappedProcessorAfterUnfuse(unittest.TestCase):
    """The way out that the refusal of a wrapped stock processor names: the wrapper set after `unfuse` runs the
    head-dim twin it installs, and the sharded model computes the user's model (Sana: 0.195 off when the wrapper
    around the stock processor was sharded)."""

    def test_sharded_equals_the_users_model(self):
        for rank, r in enumerate(results()):
            with self.subTest(rank=rank):
                self.assertTrue(r["sana_wrapped"]["wrapped"])
                self.assertTrue(all(n.startswith("HeadDim") for n in r["sana_wrapped"]["wrapped"]))  # the twins
                self.assertLess(r["sana_wrapped"]["forward"], FP32_TOL)
