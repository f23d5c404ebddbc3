"""The unfused model looks like the stock one to diffusers' name-based features, for every family: the blocks that
regional compile (`_repeated_blocks`) and device maps (`_no_split_modules`) find by class name, and the modules
TaylorSeer hooks by path; `fuse` leaves no instance override behind. (Outputs of each feature: tests/families/test_conformance.)"""

from __future__ import annotations

import copy
import re
import unittest

from diffusers.hooks.taylorseer_cache import _TRANSFORMER_BLOCK_IDENTIFIERS
from parameterized import parameterized

import conformance_worker as W
import surgery
from surgery.integration.interop import BLOCK_NAME_LISTS

FAMILIES = [(f.name,) for f in W.conformant_families()]


def named(model, attr: str) -> list[str]:
    names = set(getattr(model, attr, None) or [])
    return [n for n, m in model.named_modules() if type(m).__name__ in names]


def taylorseer_paths(model) -> list[str]:
    return [n for n, _ in model.named_modules() if any(re.fullmatch(p, n) for p in _TRANSFORMER_BLOCK_IDENTIFIERS)]


class DropIn(unittest.TestCase):
    @parameterized.expand(FAMILIES)
    def test_blocks_and_hooked_paths_are_the_stock_ones(self, family_name):
        family = surgery.extend.families()[family_name]
        _, _, stock = W.make(family_name, next(iter(family.tests.configs)))
        model = surgery.unfuse(copy.deepcopy(stock))
        for attr in BLOCK_NAME_LISTS:
            self.assertEqual(named(model, attr), named(stock, attr), attr)
        self.assertEqual(taylorseer_paths(model), taylorseer_paths(stock))
        # no module name a stock LoRA target or TaylorSeer pattern would newly select
        new = {n for n, _ in model.named_modules()} - {n for n, _ in stock.named_modules()}
        self.assertFalse([n for n in new if re.search(r"(^|\.)(to_q|to_k|to_v|attn)$", n)], new)
        surgery.fuse(model)
        self.assertFalse([a for a in BLOCK_NAME_LISTS if a in vars(model)])
