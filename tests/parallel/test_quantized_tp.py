"""torchao quantization and tensor parallelism in either order (2 gloo ranks), against the same quantized model run
whole on one process."""

import functools
import unittest

from parameterized import parameterized

from surgery.testing import FP32_TOL, run_on_cpu_ranks
import quant_worker

WORLD = 2
# Same int8 weights and scales, same math: only float summation order differs.
EXACT = ["int8_weight_only", "float8_weight_only", "int8_groups_of_16"]


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_on_cpu_ranks(quant_worker.run, WORLD)


class QuantizeThenShard(unittest.TestCase):
    @parameterized.expand([(n,) for n in [*EXACT, "int8_dynamic_activation"]])
    def test_the_reference_is_quantized(self, name):
        # the whole quantized model runs its quantized weights (its error against float is quantization's, far
        # above float noise), so agreeing with it says the sharded model runs them too
        for result in results():
            self.assertGreater(result[name]["whole_vs_float"], 100 * FP32_TOL)

    @parameterized.expand([(n,) for n in EXACT])
    def test_equals_whole_quantized_model(self, name):
        for rank, result in enumerate(results()):
            self.assertLessEqual(result[name]["before"], FP32_TOL, f"rank {rank}")

    def test_dynamic_activation_one_layer_pair_equals_whole(self):
        for rank, result in enumerate(results()):
            self.assertLessEqual(result["dynamic_two_linears"], FP32_TOL, f"rank {rank}")

    def test_dynamic_activation_model_within_its_own_noise_sensitivity(self):
        # Dynamic activation quantization rounds each activation to int8 per token: the float noise of another
        # summation order upstream moves some across a rounding boundary (one int8 step each), and later layers carry
        # that on. The whole quantized model moves as far under 1e-7 relative input noise; the sharded one may differ
        # from it by no more than twice that.
        for rank, result in enumerate(results()):
            row = result["int8_dynamic_activation"]
            self.assertLessEqual(row["before"], 2 * row["sensitivity"], f"rank {rank}")

    @parameterized.expand([(n,) for n in [*EXACT, "int8_dynamic_activation"]])
    def test_each_rank_holds_its_quantized_shards(self, name):
        for result in results():
            row = result[name]
            self.assertGreater(row["before_sharded"], 0)
            self.assertEqual(row["before_bytes"], row["before_expected_bytes"])
            self.assertLess(row["before_bytes"], row["whole_bytes"])

    def test_a_cut_inside_a_block_is_refused_with_the_numbers(self):
        for result in results():
            message = result["refusals"]["group_32"]
            self.assertIsNotNone(message)
            for part in ("transformer_blocks.0.ff.linear_out.weight", "blocks of 32", "160 columns", "shards of 80"):
                self.assertIn(part, message)


class OwnCopies(unittest.TestCase):
    def test_each_rank_slices_its_own_quantized_copy(self):
        for result in results():
            self.assertLessEqual(result["src_data_rank=None"]["error"], FP32_TOL)

    def test_ranks_holding_other_quantized_weights_are_refused(self):
        for result in results():
            message = result["src_data_rank=None"]["different weights"]
            self.assertIsNotNone(message)
            self.assertIn("weights", message)


class MidwayFailure(unittest.TestCase):
    def test_every_rank_puts_its_quantized_weights_back_and_shards_again(self):
        for rank, result in enumerate(results()):
            for src in (0, None):
                with self.subTest(rank=rank, src_data_rank=src):
                    row = result["midway"][src]
                    self.assertIn("simulated: out of memory while sharding", row["error"] or "")
                    self.assertTrue(row["same"])
                    self.assertLessEqual(row["retry"], FP32_TOL)


class ShardThenQuantize(unittest.TestCase):
    @parameterized.expand([(n,) for n in EXACT])
    def test_equals_whole_quantized_model(self, name):
        for result in results():
            self.assertLessEqual(result[name]["after"], FP32_TOL)

    def test_dynamic_activation_same_as_quantized_first(self):
        for result in results():
            row = result["int8_dynamic_activation"]
            self.assertEqual(row["after"], row["before"])

    @parameterized.expand([(n,) for n in [*EXACT, "int8_dynamic_activation"]])
    def test_same_bytes_either_order(self, name):
        for result in results():
            self.assertEqual(result[name]["after_bytes"], result[name]["before_bytes"])


class StockParallelizeModule(unittest.TestCase):
    """What stock `parallelize_module` does with the same quantized model and plan: it cannot cut the weights."""

    @parameterized.expand([(n,) for n in [*EXACT, "int8_dynamic_activation"]])
    def test_fails_where_surgery_shards(self, name):
        self.assertIn("NotImplementedError", results()[0][name]["stock"])


class Planner(unittest.TestCase):
    @parameterized.expand([("int8_weight_only",), ("float8_weight_only",)])
    def test_surgery_plan_quant_predicts_the_bytes_each_rank_holds(self, name):
        for result in results():
            self.assertEqual(result[name]["planned_bytes"], result[name]["before_bytes"])
