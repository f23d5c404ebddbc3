"""Real multi-process tensor parallelism (gloo, world 2 and 4) against the single-device fused model."""

import functools
import unittest

from parameterized import parameterized

from surgery.testing import run_on_cpu_ranks
import tp_worker

from surgery.testing import FP32_GRAD_TOL, FP32_TOL
WORLDS = (2, 4)


@functools.lru_cache(maxsize=None)
def results(world: int) -> list[dict]:
    """One spawned job per world size runs every check; each test reads its part (per rank)."""
    return run_on_cpu_ranks(tp_worker.run, world)


CASES = [(world, f"{c[0]}-{c[1]}") for world in WORLDS for c in tp_worker.CASES[world]]


class Equivalence(unittest.TestCase):
    @parameterized.expand(CASES)
    def test_forward(self, world, case):
        for rank, result in enumerate(results(world)):
            self.assertLessEqual(result["cases"][case]["forward"], FP32_TOL, f"rank {rank}")

    @parameterized.expand(CASES)
    def test_backward_gathered_gradients(self, world, case):
        for result in results(world):
            grads = result["cases"][case]["backward"]
            self.assertGreater(grads["sharded_params"], 0)
            self.assertLessEqual(grads["input"], FP32_GRAD_TOL)
            self.assertLessEqual(grads["params"], FP32_GRAD_TOL)

    @parameterized.expand([(w,) for w in WORLDS])
    def test_kv_cache_modes(self, world):
        for result in results(world):
            self.assertLessEqual(result["kv"]["extract"], FP32_TOL)
            self.assertLessEqual(result["kv"]["cached"], FP32_TOL)


class Cost(unittest.TestCase):
    @parameterized.expand(CASES)
    def test_per_rank_bytes_are_replicated_plus_sharded_over_world(self, world, case):
        for result in results(world):
            r = result["cases"][case]
            self.assertEqual(r["sharded_not_as_intended"], [])
            self.assertAlmostEqual(r["bytes"] / r["expected_bytes"], 1.0, delta=0.01)

    @parameterized.expand(CASES)
    def test_collectives_no_more_than_diffusers_packed_plan(self, world, case):
        for result in results(world):
            r = result["cases"][case]
            self.assertLessEqual(r["diffusers_forward"], FP32_TOL)  # their plan is a fair baseline
            self.assertEqual(set(r["collectives"]), {"all_reduce"})
            self.assertLessEqual(sum(r["collectives"].values()), sum(r["diffusers_collectives"].values()))

    @parameterized.expand([(w,) for w in WORLDS])
    def test_one_all_reduce_per_single_block_and_four_per_double_block(self, world):
        config = tp_worker.small_config("klein9b_small")
        expected = 4 * config["num_layers"] + config["num_single_layers"]
        for result in results(world):
            self.assertEqual(result["cases"]["klein9b_small-0"]["collectives"], {"all_reduce": expected})


class SourceRank(unittest.TestCase):
    @parameterized.expand([(w,) for w in WORLDS])
    def test_none_shards_without_any_collective(self, world):
        for result in results(world):
            # no weight moves: the only collectives are the ranks' agreement exchanges (all_gather_object: sizes,
            # then a few hundred bytes of verdicts and digests), one before sharding and one per block after it
            config = tp_worker.small_config("tp_wide")
            exchanges = 1 + config["num_layers"] + config["num_single_layers"]
            counts, sent = result["src_data_rank"]["none_sharding_collectives"]
            self.assertEqual(counts, {"allgather_": 2 * exchanges})
            self.assertLess(sent, 1024 * exchanges)
            self.assertLessEqual(result["src_data_rank"]["none_forward"], FP32_TOL)

    @parameterized.expand([(w,) for w in WORLDS])
    def test_default_gives_every_rank_rank_zeros_weights(self, world):
        for result in results(world):
            self.assertLessEqual(result["src_data_rank"]["rank0_forward"], FP32_TOL)


    @parameterized.expand([(w,) for w in WORLDS])
    def test_host_side_placement_moves_only_shards(self, world):
        for result in results(world):
            for key, (equal, extra) in result["place"].items():
                self.assertTrue(equal, key)
                self.assertEqual(extra, 0 if key.endswith("none") else True, key)


class DiffusersAPI(unittest.TestCase):
    @parameterized.expand([(w,) for w in WORLDS])
    def test_instance_tp_plan_shards_the_unfused_model(self, world):
        config = tp_worker.small_config("klein9b_small")
        for result in results(world):
            r = result["enable_parallelism"]
            self.assertLessEqual(r["forward"], FP32_TOL)
            # plain rowwise entries: the single block all-reduces its attention and MLP outputs separately
            self.assertEqual(r["collectives"], {"all_reduce": 4 * config["num_layers"] + 2 * config["num_single_layers"]})


class Refusals(unittest.TestCase):
    EXPECTED = {
        "fused": r"'transformer_blocks.0.ff' is still a fused Flux2FeedForward .*Call surgery.unfuse\(model\) first",
        "heads": r"'transformer_blocks.0.attn.to_q' holds 5 heads of 12, which a mesh of 2 cannot split evenly.*\[1, 5\]",
        "mlp_hidden": r"'transformer_blocks.0.ff.linear_in.gate' has 161 output features, which a mesh of 2 cannot",
        "twice": r"'transformer_blocks.0.attn.to_q.weight' is already sharded .*applied already",
        "peft": r"'transformer_blocks.0.attn.to_q' is wrapped by a PEFT/LoRA adapter",
    }

    def test_each_bad_input_raises_clearly_and_leaves_the_model_unsharded(self):
        for rank, result in enumerate(results(2)):
            for key, pattern in self.EXPECTED.items():
                self.assertIsNotNone(result["refusals"][key]["error"], key)
                self.assertRegex(result["refusals"][key]["error"], pattern)

    def test_two_dimensional_mesh_and_its_named_sub_mesh(self):
        for result in results(4):
            self.assertRegex(result["refusals"]["mesh_2d"]["error"], r"2 dimensions \(2, 2\).*mesh\['tp'\]")
            self.assertLessEqual(result["refusals"]["sub_mesh_forward"], FP32_TOL)
