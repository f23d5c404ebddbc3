"""Loads and rewrites that cannot be right are refused (issue 18), `strict=False` included, before anything changes
where torch itself would: a fused tensor of another size, a state dict with both layouts of one tensor, a tie to a
module outside the model (inside `torch.inference_mode()` `unfuse` works as stock: tests/core/test_inference_mode.py)."""

import copy
import unittest

import torch
import torch.nn as nn

import surgery
from flux2_testing import build, inputs, small_config

CONFIG = small_config("klein4b_small")
FUSED = "single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"
PART = "single_transformer_blocks.0.attn.to_qkv_mlp_proj.v.weight"


def values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


class LoadStateDict(unittest.TestCase):
    def setUp(self):
        self.stock = build(CONFIG, 1)
        self.model = surgery.unfuse(build(CONFIG, 0))
        self.before = values(self.model)

    def assert_parts_unchanged(self):
        """The parts of the refused fused tensor keep their values (other keys load, as in stock torch)."""
        after = self.model.state_dict()
        parts = [s.unfused for s in surgery.state_dict.weight_slices(self.model) if s.fused == FUSED]
        self.assertEqual(len(parts), 5)
        for key in parts:
            self.assertTrue(torch.equal(after[key], self.before[key]), key)

    def test_a_fused_tensor_of_another_size_is_refused_with_strict_false_too(self):
        source = dict(self.stock.state_dict())
        source[FUSED] = torch.cat([source[FUSED], torch.zeros(8, source[FUSED].shape[1])])
        rows = source[FUSED].shape[0]
        # what stock torch says of the same tensor on the stock model, strict or not
        for strict in (True, False):
            with self.assertRaisesRegex(RuntimeError, rf"size mismatch for {FUSED}: copying a param with shape "
                                                      rf"torch.Size\(\[{rows}, \d+\]\) from checkpoint"):
                copy.deepcopy(self.stock).load_state_dict(source, strict=strict)
        for strict in (True, False):
            with self.subTest(strict=strict), self.assertRaises(RuntimeError) as raised:
                self.model.load_state_dict(source, strict=strict)
            message = str(raised.exception)
            self.assertRegex(message, rf"size mismatch for {FUSED}: copying a param with shape torch.Size\(\[{rows}, "
                                      rf"\d+\]\) from checkpoint, the shape in current model is torch.Size\(\[{rows - 8}, "
                                      r"\d+\]\) \(fused from to_qkv_mlp_proj.q.weight, .*another config")
            self.assertNotIn("Missing key", message)  # the cause, not its consequence
            self.assert_parts_unchanged()

    def test_a_state_dict_with_both_layouts_of_a_tensor_is_refused(self):
        source = dict(self.stock.state_dict())
        source[PART] = torch.full_like(self.model.state_dict()[PART], 7.0)  # disagrees with the fused rows
        for strict in (True, False):
            with self.subTest(strict=strict), self.assertRaisesRegex(
                    RuntimeError, rf"{FUSED} and its unfused parts \({PART}\) are both in the state dict"):
                self.model.load_state_dict(source, strict=strict)
            self.assert_parts_unchanged()
        slices = surgery.state_dict.weight_slices(self.model)
        with self.assertRaisesRegex(surgery.SurgeryError, rf"the fused state dict also holds '{PART}' of the other "
                                                          "layout .*ambiguous"):
            surgery.state_dict.unfuse_state_dict(source, slices)
        unfused = surgery.state_dict.unfuse_state_dict(self.stock.state_dict(), slices)
        unfused[FUSED] = self.stock.state_dict()[FUSED]
        with self.assertRaisesRegex(surgery.SurgeryError, rf"the unfused state dict also holds '{FUSED}'"):
            surgery.state_dict.fuse_state_dict(unfused, slices)

    def test_either_layout_alone_still_loads(self):
        for source in (self.stock.state_dict(), surgery.unfuse(copy.deepcopy(self.stock)).state_dict()):
            model = surgery.unfuse(build(CONFIG, 0))
            self.assertEqual(model.load_state_dict(source, strict=True).missing_keys, [])
            kw = inputs(CONFIG, 0)
            with torch.no_grad():
                self.assertTrue(torch.allclose(model(**kw).sample, self.stock(**kw).sample, atol=1e-5, rtol=1e-5))


class RewriteRefusals(unittest.TestCase):
    def test_a_tie_to_a_module_outside_the_model_is_refused(self):
        model = build(CONFIG, 0)
        outside = nn.Linear(1, 1)
        outside.weight = model.single_transformer_blocks[0].attn.to_qkv_mlp_proj.weight
        before = values(model)
        with self.assertRaisesRegex(surgery.SurgeryError, rf"'{FUSED}' is tied to the parameter 'weight' of a Linear "
                                                          r"outside the model.*Untie them first"):
            surgery.unfuse(model)
        self.assertIsInstance(model.single_transformer_blocks[0].attn.to_qkv_mlp_proj, nn.Linear)
        self.assertTrue(all(torch.equal(v, before[k]) for k, v in model.state_dict().items()))
        outside.weight = nn.Parameter(outside.weight.detach().clone())  # the fix the message gives
        surgery.unfuse(model)


class EveryFamily(unittest.TestCase):
    """The load pre-hook on every family that rewrites: either layout loads (strict), a fused tensor with 8 rows or
    columns too many is refused (strict=False too)."""

    def test_either_layout_loads_and_a_resized_fused_tensor_is_refused(self):
        from surgery.core.registry import families
        from surgery.testing import seeded_model

        for name, family in sorted(families().items()):
            if not family.tests.configs or not family.rewrites:
                continue
            config = next(iter(family.tests.configs.values()))
            with self.subTest(name):
                stock = seeded_model(family, config, 1)
                slices = surgery.state_dict.weight_slices(stock)
                if not slices:
                    continue
                for source in (stock.state_dict(), surgery.unfuse(copy.deepcopy(stock)).state_dict()):
                    model = surgery.unfuse(seeded_model(family, config, 0))
                    self.assertEqual(model.load_state_dict(source, strict=True).missing_keys, [])
                    want = surgery.unfuse(copy.deepcopy(stock)).state_dict()
                    self.assertTrue(all(torch.equal(v, want[k]) for k, v in model.state_dict().items()))
                fused_name, dim = slices[0].fused, slices[0].dim
                source = dict(stock.state_dict())
                extra = list(source[fused_name].shape)
                extra[dim] = 8
                source[fused_name] = torch.cat([source[fused_name], torch.zeros(extra)], dim)
                for strict in (True, False):
                    with self.assertRaisesRegex(RuntimeError, rf"size mismatch for {fused_name}"):
                        surgery.unfuse(seeded_model(family, config, 0)).load_state_dict(source, strict=strict)


if __name__ == "__main__":
    unittest.main()
