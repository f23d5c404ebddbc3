"""LoRA adapters on a tensor-parallel model (2 gloo ranks), without merging: load (each rank reads its slices),
several adapters with weights, fuse/unfuse, delete, save, unload, hot-swap under torch.compile, refusals — each vs
the stock single-device model with the same adapter, for FLUX.2 and FLUX.1.

One spawned job runs everything (tests/workers/lora_tp_worker.py); each test reads its part, on every rank.
"""

import functools
import tempfile
import unittest

from surgery.testing import run_on_cpu_ranks
import lora_tp_worker

from surgery.testing import FP32_TOL
FAMILIES = tuple(lora_tp_worker.CASES)
OPERATIONS = ("load (file, sliced)", "set_adapters with weights (two adapters)", "fuse_lora",
              "unfuse_lora + set_adapters", "delete_adapters", "save_lora_adapter -> stock load",
              "unload_lora_weights", "hotswap: compiled, first adapter", "hotswap: same rank",
              "hotswap: smaller rank", "hotswap: still the small adapter after the refusal",
              "refusals left the adapter working")


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="surgery-lora-tp-") as shared:
        return run_on_cpu_ranks(lora_tp_worker.run, 2, shared)


class AdaptersOnAShardedModel(unittest.TestCase):
    def test_every_operation_matches_the_stock_model_with_the_same_adapter(self):
        for rank, result in enumerate(results()):
            for family in FAMILIES:
                for op in OPERATIONS:
                    with self.subTest(rank=rank, family=family, op=op):
                        self.assertLessEqual(result[family][op], FP32_TOL)

    def test_factors_are_sharded_and_each_rank_reads_only_its_slices(self):
        for result in results():
            for family in FAMILIES:
                r = result[family]
                self.assertIn("DTensor(Shard(dim=0),)", r["placements"])  # lora_B of colwise bases
                self.assertIn("DTensor(Shard(dim=1),)", r["placements"])  # lora_A of rowwise bases
                self.assertEqual(r["elements read"], r["elements held"])
                self.assertLess(r["elements read"], r["elements in the file"])

    def test_a_partial_base_adds_no_collective(self):
        # one all-reduce per single block and 4 per double block without adapters; with one, each rowwise base whose
        # output is all-reduced (the double block's 4) reduces its lora_A output (rank wide) too; the single block's
        # partial outputs join its one all-reduce
        for result in results():
            self.assertEqual(result["flux2"]["collectives with adapter"], {"all_reduce": 4 * 1 + 6 + 4})
            self.assertEqual(result["flux1"]["collectives with adapter"], {"all_reduce": 4 * 1 + 2 + 4})

    def test_hotswap_recompiles_nothing(self):
        for result in results():
            for family in FAMILIES:
                r = result[family]
                self.assertEqual(r["graphs compiled at the first call"], 1)  # the counter counts
                self.assertEqual(r["graphs compiled by the swaps"], 0)
                self.assertEqual(r["recompilations by the swaps"], 0)

    def test_saved_adapter_is_the_published_one(self):
        for result in results():
            for family in FAMILIES:
                r = result[family]
                self.assertTrue(r["saved keys"] and r["saved exact"] and r["stock_lora_adapter plain tensors"])
                self.assertEqual(r["adapters left"], ["one"])
                self.assertTrue(r["no lora left"])

    def test_bad_adapters_are_refused_on_every_rank_and_change_nothing(self):
        expected = {
            "refuse: larger rank than prepared": r"has rank 16, larger than the 8 .*enable_lora_hotswap\(target_rank=16\)",
            "refuse: another family": r"(not a module of this|made for another width)",
            "refuse: another width": r"(another model or config|another width)",
            "refuse: targets that do not exist": r"single_transformer_blocks\.99\..*not a module of this",
            "refuse: corrupt file (on rank 0 only)": r"rank 0: cannot read the adapter file .*\(rank 1 stopped with it\)",
            "refuse: DoRA": r"^Flux2?Transformer2DModel.add_adapter: DoRA is not supported on a sharded model; .*use plain "
                            r"LoRA \(use_dora=False\) on the sharded model.$",
        }
        for rank, result in enumerate(results()):
            for family in FAMILIES:
                for key, pattern in expected.items():
                    with self.subTest(rank=rank, family=family, case=key):
                        message = result[family][key]
                        self.assertIsNotNone(message)
                        self.assertNotIn("CHANGED", message)
                        self.assertRegex(message, pattern)


if __name__ == "__main__":
    unittest.main()
