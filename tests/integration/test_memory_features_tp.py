"""diffusers' memory features with tensor parallelism (2 gloo ranks): enabled on the sharded model they give the
unsharded model's output with the same feature; enabled before sharding, tensor_parallel refuses in one line."""

import functools
import unittest

from parameterized import parameterized

from surgery.testing import FP32_TOL, run_on_cpu_ranks
import memory_tp_worker

DIFFUSERS = ["layerwise_casting", "group_offload_block", "group_offload_leaf"]


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_on_cpu_ranks(memory_tp_worker.run, 2)


class AfterTensorParallel(unittest.TestCase):
    @parameterized.expand([(n,) for n in DIFFUSERS])
    def test_equals_unsharded_model_with_the_same_feature(self, name):
        for rank, result in enumerate(results()):
            self.assertLessEqual(result[name].get("after", float("inf")), FP32_TOL, (rank, result[name]))

    def test_layerwise_casting_stores_each_rank_shard_in_fp8(self):
        for result in results():
            self.assertEqual(result["layerwise_casting"]["local_dtypes"], ["torch.float8_e4m3fn"])

    def test_accelerate_cpu_offload_breaks_on_dtensors(self):
        # accelerate rebuilds each parameter as a plain tensor class: it cannot hold a DTensor (use diffusers' group
        # offloading on a sharded model instead, which works: above)
        for result in results():
            self.assertIn("dtensor", result["accelerate_cpu_offload"]["after_error"].lower())


class BeforeTensorParallel(unittest.TestCase):
    @parameterized.expand([(n,) for n in [*DIFFUSERS, "accelerate_cpu_offload"]])
    def test_refused_in_one_line_naming_the_module(self, name):
        for result in results():
            message = result[name]["before"]
            self.assertIsNotNone(message)
            self.assertNotIn("\n", message)
            self.assertRegex(message, r"'[^']+' \(\w+\) has (diffusers|accelerate) hooks")
            self.assertIn("enable them again afterwards", message)
