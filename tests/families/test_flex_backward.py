"""The families whose stock attention runs `flex` attention (`Tests.flex_backward`): the conformance suite proves
their forwards with the stock flex kernel and, since flex attention has no backward on CPU, their gradients (and
forwards again) with the kernel the family names, the `BlockMask` made dense (`surgery.testing.flex_as`). What
makes that sound is checked here: the dense mask is the blocks a mask lists and its `mask_mod` admits, the stock
backward is really refused on CPU, the substitute runs the stock processor's attention (same query, key, value,
scale and mask reading), and each family's mask decides its result (a wrong dense mask would show)."""

from __future__ import annotations

import unittest
from unittest import mock

import torch
from parameterized import parameterized
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

import conformance_worker as W
import surgery.testing
from surgery.testing import dense_mask, flex_as, rel_err

FLEX = [(f.name,) for f in W.conformant_families() if f.tests.flex_backward]


def _name(func, num, params):
    return f"{func.__name__}_{params.args[0].replace('-', '_')}"


def _run(family_name: str, grad: bool = False):
    family = W.families()[family_name]
    _, config, model = W.make(family_name, next(iter(family.tests.configs)))
    kw = W.inputs(family, config, 0)
    if grad:
        kw = {k: v.requires_grad_(True) if k in W.floating_inputs(kw) else v for k, v in kw.items()}
    return family, model, kw


class DenseMask(unittest.TestCase):
    def test_listed_full_blocks_are_the_mask(self):
        # NABLA's way: blocks listed as full, no mask_mod; the reference is the block matrix itself, spread
        blocks = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(0)) < 0.5
        blocks |= torch.eye(4, dtype=torch.bool)
        mask = BlockMask.from_kv_blocks(torch.zeros(2, 3, 4, dtype=torch.int32),
                                        torch.zeros(2, 3, 4, 4, dtype=torch.int32),
                                        blocks.sum(-1).int(), blocks.int().argsort(-1, descending=True).int(),
                                        BLOCK_SIZE=8)
        expected = blocks.repeat_interleave(8, -2).repeat_interleave(8, -1)
        self.assertTrue(torch.equal(dense_mask(mask, 32, 32), expected))

    def test_a_mask_mod_in_partial_blocks_past_the_sequence(self):
        # AnyFlow-FAR's way: create_block_mask from a mask_mod, 200 tokens in blocks of 128 (partial blocks)
        causal = lambda b, h, q, k: q >= k  # noqa: E731
        mask = create_block_mask(causal, None, None, 200, 200, device="cpu")
        self.assertTrue(torch.equal(dense_mask(mask, 200, 200)[0, 0], torch.ones(200, 200, dtype=torch.bool).tril()))


class FlexBackward(unittest.TestCase):
    def test_some_family_uses_it(self):
        self.assertGreaterEqual(len(FLEX), 2)

    @parameterized.expand(FLEX, name_func=_name)
    def test_the_stock_backward_is_refused_on_cpu(self, family_name):
        # were torch to give flex attention a CPU backward, the family should drop `flex_backward`
        _, model, kw = _run(family_name, grad=True)
        with self.assertRaisesRegex(NotImplementedError, "does not support backward on CPU"):
            W.output(model, kw).sum().backward()

    @parameterized.expand(FLEX, name_func=_name)
    def test_the_substitute_runs_the_stock_attention_and_its_mask_decides(self, family_name):
        family, model, kw = _run(family_name)

        def eager(mask, q_len, kv_len):  # eager flex reads the mask_mod only (the listing is compiled flex's)
            return create_mask(mask.mask_mod, 1, 1, q_len, kv_len, device="cpu")

        def everything(mask, q_len, kv_len):
            return torch.ones(q_len, kv_len, dtype=torch.bool)

        with torch.no_grad():
            stock = W.output(model, kw)
            with flex_as(family.tests.flex_backward):
                substitute = W.output(model, kw)
            with mock.patch.object(surgery.testing, "dense_mask", eager), flex_as(family.tests.flex_backward):
                self.assertLessEqual(rel_err(W.output(model, kw), stock), W.FP32_TOL)
            with mock.patch.object(surgery.testing, "dense_mask", everything), flex_as(family.tests.flex_backward):
                self.assertGreater(rel_err(W.output(model, kw), substitute), 1e-3)


if __name__ == "__main__":
    unittest.main()
