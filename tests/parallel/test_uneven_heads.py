"""Heads a mesh does not divide: `tensor_parallel(..., pad_heads=True)` against the single-device model (gloo).

World 3 (FLUX.2 with 4 heads, SD3.5 with 4 heads, an adapter) runs in the default tier; worlds 4 and 5 (FLUX.2 with
6 heads) in the heavy tier.
"""

import copy
import functools
import tempfile
import unittest

import pytest
import torch

import surgery
import uneven_heads_worker
from surgery.core import heads_padding
from surgery.core.build import seeded_model
from surgery.core.registry import families
from surgery.parallel.distributed import fake_process_group
from surgery.parallel.padding import head_paddings
from surgery.parallel.plans import block_path, planned_for
from surgery.sight import report
from surgery.testing import FP32_GRAD_TOL, FP32_TOL, rel_err, run_on_cpu_ranks


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


# --- one process: the padding itself, fuse, save, refusals and the plan's cost ----------------------------------------

FLUX2_6 = uneven_heads_worker.CASES[4][0][1]


def padded(model, world):
    """`model` padded in place as tensor_parallel(..., pad_heads=True) pads it for `world` ranks, unsharded."""
    found = head_paddings(model, planned_for(model), world, lambda path: block_path(model, path)[0])
    for p in found:
        heads_padding.pad(model.get_submodule(p.block), [p.padding])
    return model, found


def forward(model, kw):
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]


class Unsharded(unittest.TestCase):
    def setUp(self):
        self.family = families()["flux2"]
        self.fused = seeded_model(self.family, FLUX2_6, 3)
        self.kw = self.family.example_inputs(FLUX2_6, batch=2, seed=3)

    def test_padded_forward_is_the_stock_one_and_unpad_gives_the_values_back(self):
        model = surgery.unfuse(copy.deepcopy(self.fused))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        _, found = padded(model, 4)
        self.assertEqual({p.padding.heads for p in found}, {(6, 8)})
        self.assertEqual(model.transformer_blocks[0].attn.to_q.weight.shape[0], 64)
        self.assertLessEqual(rel_err(forward(model, self.kw), forward(self.fused, self.kw)), FP32_TOL)
        heads_padding.unpad(model)
        after = model.state_dict()
        self.assertTrue(all(torch.equal(before[k], after[k]) for k in before))
        self.assertEqual(heads_padding.padded_blocks(model), [])

    def test_grouped_query_heads_keep_their_key_value_head(self):
        family = families()["lumina2"]
        config = family.tests.configs["tiny"]  # 8 query heads over 4 key/value heads
        stock = seeded_model(family, config, 4)
        kw = family.example_inputs(config, batch=2, seed=4)
        model, found = padded(surgery.unfuse(copy.deepcopy(stock)), 3)
        self.assertEqual({(p.padding.heads, p.padding.kv_heads) for p in found}, {((8, 12), (4, 6))})
        self.assertLessEqual(rel_err(forward(model, kw), forward(stock, kw)), FP32_TOL)

    def test_fuse_and_save_give_the_stock_model_bitwise(self):
        for verb in ("fuse", "save"):
            model, _ = padded(surgery.unfuse(copy.deepcopy(self.fused)), 4)
            if verb == "fuse":
                back = surgery.fuse(model)
            else:
                with tempfile.TemporaryDirectory() as folder:
                    surgery.save_pretrained(model, folder)
                    back = type(self.fused).from_pretrained(folder)
            want, got = self.fused.state_dict(), back.state_dict()
            self.assertEqual(list(want), list(got), verb)
            self.assertTrue(all(want[k].shape == got[k].shape and torch.equal(want[k], got[k]) for k in want), verb)

    def assert_refused_untouched(self, model, world: int, message: str):
        """`tensor_parallel(model, mesh of world, pad_heads=True)` raises `message`; the model is as it was."""
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with fake_process_group(world):
            mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
            with self.assertRaisesRegex(surgery.SurgeryError, message):
                surgery.tensor_parallel(model, mesh, pad_heads=True)
        after = model.state_dict()
        self.assertTrue(all(before[k].shape == after[k].shape and torch.equal(before[k], after[k]) for k in before))
        self.assertEqual(heads_padding.padded_blocks(model), [])

    def test_across_heads_norm_refused_model_untouched(self):
        family = families()["wan"]  # q/k norms over the whole width: their statistic would count zero heads
        model = surgery.unfuse(seeded_model(family, family.tests.configs["tiny"], 0))
        self.assert_refused_untouched(model, 3, "norm_q' normalizes 32 features across the heads")

    def test_a_later_refusal_puts_the_heads_back(self):
        config = {**FLUX2_6, "mlp_ratio": 3.0}  # 144 MLP units, which 5 ranks do not split: refused after padding
        model = surgery.unfuse(seeded_model(self.family, config, 0))
        self.assert_refused_untouched(model, 5, "has 144 output features")
        self.assertEqual((model.transformer_blocks[0].attn.heads, model.transformer_blocks[0].attn.inner_dim), (6, 48))

    def test_plan_shows_the_cost_per_rank(self):
        result = report.plan(FLUX2_6, 4, family=self.family, dtype=torch.float32, image_tokens=16, text_tokens=8)
        dim, extra = 48, (8 - 6) * 8  # model width; zero heads x head_dim
        # double-stream: 6 q/k/v projections (rows) and 2 outputs (columns); single-stream: 3 and 1
        elements = FLUX2_6["num_layers"] * 8 * extra * dim + FLUX2_6["num_single_layers"] * 4 * extra * dim
        pad = result["padding"]
        self.assertEqual(pad["heads"], [(6, 8)])
        self.assertEqual(pad["bytes_per_rank"], elements * 4 // 4)
        self.assertEqual(pad["projection_flops_per_token_per_rank"], 2 * elements // 4)
        attentions = FLUX2_6["num_layers"] + FLUX2_6["num_single_layers"]
        self.assertEqual(pad["attention_flops_per_token_per_key_per_rank"], attentions * 2 * 4 * 8 // 4)
        self.assertEqual(result["heads"], [(0, 2), (2, 4), (4, 6), (6, 6)])
