"""2-D meshes on 4 gloo ranks: TP x context parallelism (diffusers' Ulysses), TP x FSDP2 training (with and without
PEFT LoRA), vs one device.

One spawned job runs every 4-rank check (see tests/workers/two_d_worker.py); each test reads its part, on every rank.
"""

import pytest
import functools
import unittest

from surgery.testing import run_on_cpu_ranks
import two_d_worker

pytestmark = pytest.mark.heavy  # the heavy tier: CI's second command (tests/conftest.py)

from surgery.testing import FP32_GRAD_TOL, FP32_TOL


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_on_cpu_ranks(two_d_worker.run, 4)


class TensorTimesContextParallel(unittest.TestCase):
    def test_tp2_cp2_ulysses_forward_matches_the_fused_model(self):
        config = two_d_worker.small_config("tp_wide")
        layers = config["num_layers"] + config["num_single_layers"]
        for rank, result in enumerate(results()):
            r = result["tp_cp"]
            self.assertLessEqual(r["tp2_cp2"], FP32_TOL, f"rank {rank}")
            # q, k, v in and the output back per attention; TP's all-reduces; one gather of the output sequence
            self.assertEqual(r["tp2_cp2_collectives"], {"all_to_all_single": 4 * layers,
                                                        "all_reduce": 4 * config["num_layers"] +
                                                        config["num_single_layers"],
                                                        "all_gather_into_tensor": 1})

    def test_cp4_alone_on_the_stock_fused_model(self):
        for result in results():
            self.assertLessEqual(result["tp_cp"]["cp4"], FP32_TOL)
            self.assertNotIn("all_reduce", result["tp_cp"]["cp4_collectives"])

    def test_calls_that_context_parallelism_would_get_wrong_are_refused(self):
        expected = {
            "kv_extract": r"called with \['kv_cache_mode'\]; KV-cache modes .* \(tensor parallelism alone "
                          r"supports them\)",
            "return_dict": r"with return_dict=False",
            "flat_ids": r"'img_ids' has 2 dimensions \(16, 4\).*splits it along dim 1 only when it has 3",
        }
        for result in results():
            for key, pattern in expected.items():
                self.assertIsNotNone(result["tp_cp"]["calls"][key], key)
                self.assertRegex(result["tp_cp"]["calls"][key], pattern)


class TensorTimesFSDP2(unittest.TestCase):
    def test_gradients_and_an_sgd_step_match_one_device(self):
        for result in results():
            r = result["training"]["sgd"]
            self.assertGreater(r["changed"], 1e-3)  # the step moved the parameters
            self.assertLessEqual(r["grads"], FP32_GRAD_TOL)
            self.assertLessEqual(r["params"], FP32_GRAD_TOL)
            # parameters sharded over both dimensions: FSDP2 on "dp" over TP's shards on "tp"
            self.assertIn("(_StridedShard(dim=0, sf=2), Shard(dim=0))", r["placements"])

    def test_an_adamw_step_matches_one_device(self):
        # Adam's first step is lr * g / (|g| + eps): with a small eps it is about lr * sign(g), and gradient
        # differences of ~1e-7 on near-zero gradients flip single updates, so a bound loose enough for that is also met
        # by a skipped step. With eps = 1 the step is smooth in g (about lr * g for small g), so it is compared tightly,
        # and the step itself (lr = 1) moves the parameters by far more than the tolerance.
        for result in results():
            r = result["training"]["adamw"]
            self.assertLessEqual(r["grads"], FP32_GRAD_TOL)
            self.assertLessEqual(r["params"], FP32_GRAD_TOL)
            self.assertGreater(r["changed"], 1e3 * r["max_abs_param_diff"])


class LoRAOnTensorTimesFSDP2(unittest.TestCase):
    def test_peft_adapters_on_the_unfused_linears_train_like_one_device(self):
        for result in results():
            r = result["lora"]
            # every kind of sharded Linear: colwise, rowwise all-reduced, rowwise with a partial output
            self.assertEqual(r["adapters"], two_d_worker.LORA_TARGET_COUNT, r["targets"])
            self.assertIn("single_transformer_blocks.0.attn.to_out.attn_part", r["targets"])
            self.assertIn("single_transformer_blocks.0.attn.to_qkv_mlp_proj.gate", r["targets"])
            self.assertIn("transformer_blocks.0.ff.linear_in.up", r["targets"])
            self.assertTrue(r["trainable"])  # only LoRA factors have gradients: base weights frozen
            self.assertTrue(r["frozen_unchanged"])
            self.assertGreater(r["changed"], 1e-4)
            self.assertLessEqual(r["grads"], FP32_GRAD_TOL)
            self.assertLessEqual(r["params"], FP32_GRAD_TOL)
            # factors sharded with the base's style on "tp" (Shard(0) of B / Shard(1) of A), then FSDP2 on "dp"
            self.assertIn("(Shard(dim=0), Shard(dim=1))", r["lora_placements"])
            self.assertIn("(_StridedShard(dim=0, sf=2), Shard(dim=0))", r["lora_placements"])


class PlanOnMeta(unittest.TestCase):
    """`surgery plan --tp 4 --cp 2 [--dp 2]`: full-size klein-4B on meta under the fake process group, in-process."""

    def test_collectives_by_kind_and_bytes_match_the_arithmetic(self):
        from surgery_rewrites.flux2 import VARIANTS, FAMILY
        from surgery.sight import report

        config = VARIANTS["klein-4b"]
        double, single = config["num_layers"], config["num_single_layers"]
        p = report.plan(config, 4, family=FAMILY, cp=2)  # bf16, 4096 + 512 tokens
        c = p["collectives"]
        self.assertEqual(c["ops"], {"all_to_all_single": 4 * (double + single), "all_reduce": 4 * double + single,
                                    "all_gather_into_tensor": 1})
        # each all-to-all moves this rank's q, k, v or output: tokens / cp x heads / tp x head_dim, bf16
        per_tensor = (4096 + 512) // 2 * (config["num_attention_heads"] // 4) * config["attention_head_dim"] * 2
        self.assertEqual(c["bytes_by_op"]["all_to_all_single"], 4 * (double + single) * per_tensor)
        self.assertEqual(p["tokens"]["per_rank"], 2304)

        fsdp = report.plan(config, 4, family=FAMILY, cp=2, dp=2)
        self.assertEqual(fsdp["collectives"]["fsdp_all_gathers"]["count"], double + single + 1)
        self.assertAlmostEqual(fsdp["bytes_per_rank"] / p["bytes_per_rank"], 0.5, delta=0.01)

    def test_cli(self):
        import contextlib
        import io

        from surgery.app.cli import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(main(["plan", "--model", "flux2-klein-4b", "--tp", "4", "--cp", "2", "--dp", "2"]), 0)
        self.assertIn("mesh (dp, cp, tp) = (2, 2, 4): 2304 tokens per rank", out.getvalue())
        self.assertRegex(out.getvalue(), r"all_to_all_single: 100 per forward, [\d,.]+ MiB")


class Refusals(unittest.TestCase):
    EXPECTED = {
        "local_heads": r"'transformer_blocks.0.attn' holds 6 heads / TP 2 = 3 heads per tensor-parallel rank, which "
                       r"ulysses_degree=2 cannot split evenly",
        "mesh_3d": r"the mesh has 3 dimensions \(1, 2, 2\).*mesh\['cp'\]",
        "no_cp_dim": r"no dimension named 'cp' \(names: \('dp', 'tp'\)\)",
        "whole_2d": r"2 dimensions \(2, 2\).*Pass its context-parallel sub-mesh, mesh\['cp'\]",
        "tp_mesh_as_cp": r"shares ranks with the tensor-parallel mesh",
        "ring_on_cpu": r"ring_degree=2 needs an attention backend that returns the log-sum-exp.*'native' on a cpu mesh",
        "degrees": r"ulysses_degree \(4\) x ring_degree \(1\) must equal the mesh size \(2\)",
        "wrong_order": r"surgery.tensor_parallel: .*context-parallel hooks \(call surgery.tensor_parallel before "
                       r"surgery.context_parallel",
        "twice": r"already runs with a diffusers parallel config",
    }

    def test_a_refusal_on_one_rank_is_a_refusal_on_every_rank(self):
        # ranks 0 and 1 (the first CP rank of each CP group) hold the model Ulysses cannot split; 2 and 3 do not
        for rank, result in enumerate(results()):
            self.assertRegex(result["refusals"]["one_rank"], r"6 heads / TP 2 = 3 heads per tensor-parallel rank")
            # the same message on every rank, naming the ranks that refused (surgery.parallel.agreement over the whole job)
            self.assertRegex(result["refusals"]["one_rank"], r"^surgery.context_parallel: ranks 0, 1: .*"
                                                             r"\(ranks 2, 3 stopped with it\)$")

    def test_each_refusal_names_the_fix_and_leaves_the_model_untouched(self):
        # the worker asserts the model unchanged (modules, parameters, hooks, processors) after each refusal
        for rank, result in enumerate(results()):
            for key, pattern in self.EXPECTED.items():
                self.assertIsNotNone(result["refusals"][key], f"{key} on rank {rank}")
                self.assertRegex(result["refusals"][key], pattern)


if __name__ == "__main__":
    unittest.main()
