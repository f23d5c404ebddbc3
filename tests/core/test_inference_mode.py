"""`unfuse` and `fuse` inside `torch.inference_mode()` behave as stock does there (issue 41): they work, the new
Parameters are inference tensors as stock's are when built there, and a later backward or optimizer step fails as it
fails on the stock model. diffusers' `test_group_offloading_with_disk` builds its model inside inference_mode."""

import copy
import unittest

import torch

import surgery
from flux2_testing import build, inputs, small_config
from surgery.testing import FP32_TOL, rel_err

CONFIG = small_config("klein4b_small")
LEAVES = ("single_transformer_blocks.0.attn.to_qkv_mlp_proj.q.weight",  # a row slice (a view)
          "single_transformer_blocks.0.attn.to_out.mlp_part.weight")  # a column split (a copy)


def failure(step) -> str:
    try:
        step()
    except RuntimeError as error:
        return str(error).split(".")[0]
    return "no error"


class InsideInferenceMode(unittest.TestCase):
    def setUp(self):
        with torch.inference_mode():
            self.stock = build(CONFIG, 0)
            self.model = copy.deepcopy(self.stock)
            surgery.unfuse(self.model)

    def test_unfuse_works_and_matches_the_stock_model(self):
        kwargs = inputs(CONFIG)
        with torch.inference_mode():
            expected = self.stock(**kwargs, return_dict=False)[0]
            actual = self.model(**kwargs, return_dict=False)[0]
        self.assertLess(rel_err(actual, expected), FP32_TOL)
        parameters = dict(self.model.named_parameters())
        for name in LEAVES:
            self.assertTrue(parameters[name].is_inference(), name)
        self.assertTrue(all(p.is_inference() for p in self.stock.parameters()))

    def test_fuse_gives_the_stock_model_back_bitwise(self):
        with torch.inference_mode():
            surgery.fuse(self.model)
        stock = self.stock.state_dict()
        fused = self.model.state_dict()
        self.assertEqual(list(fused), list(stock))
        self.assertTrue(all(torch.equal(fused[k], stock[k]) for k in stock))

    def test_backward_and_an_optimizer_step_fail_as_on_stock(self):
        kwargs = inputs(CONFIG)
        errors = []
        for model in (self.stock, self.model):
            backward = failure(lambda: model(**kwargs, return_dict=False)[0].sum().backward())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for p in model.parameters():
                p.grad = torch.ones(p.shape)
            errors.append((backward, failure(optimizer.step)))
        self.assertEqual(errors[1], errors[0])
        self.assertIn("Inference tensors cannot be saved for backward", errors[0][0])
        self.assertIn("Inplace update to inference tensor outside InferenceMode", errors[0][1])


class OutsideInferenceMode(unittest.TestCase):
    def test_a_model_built_inside_is_refused_outside_naming_the_parameter(self):
        with torch.inference_mode():
            model = build(CONFIG, 0)
        with self.assertRaisesRegex(surgery.SurgeryError, r"'transformer_blocks.0.ff.linear_in.weight' is an "
                                                          r"inference tensor.*outside inference_mode"):
            surgery.unfuse(model)
        self.assertIsInstance(model.transformer_blocks[0].ff.linear_in, torch.nn.Linear)


if __name__ == "__main__":
    unittest.main()
