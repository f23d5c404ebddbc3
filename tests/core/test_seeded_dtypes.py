"""`seeded_model(..., dtype)` holds every state-dict entry in the dtype diffusers' `from_pretrained(torch_dtype=...)`
loads it in: the conformance suite's half-precision cases run the model a user loads, not one of its own.

OmniGen and SD3 register their `pos_embed` buffer as float32 whatever the default dtype; diffusers' loader casts it
(a persistent buffer is a checkpoint entry), and a build that left it float32 promoted OmniGen's bf16 hidden states
into its bf16 timestep Linear ("mat1 and mat2 must have the same dtype").
"""

from __future__ import annotations

import tempfile
import unittest

import torch
from parameterized import parameterized

import surgery
from surgery.core.build import seeded_model
from surgery.core.registry import model_class


class SeededDtypes(unittest.TestCase):
    @parameterized.expand([("omnigen",), ("sd3",), ("flux3",)])
    def test_state_dict_dtypes_are_from_pretrained_s(self, family_name):
        family = surgery.extend.families()[family_name]
        config = next(iter(family.tests.configs.values()))
        seeded = seeded_model(family, config, 0, torch.bfloat16).state_dict()
        with tempfile.TemporaryDirectory() as folder:
            seeded_model(family, config, 0).save_pretrained(folder)
            loaded = model_class(family).from_pretrained(folder, torch_dtype=torch.bfloat16).state_dict()
        self.assertEqual(sorted(seeded), sorted(loaded))
        self.assertEqual({k: v.dtype for k, v in seeded.items()}, {k: v.dtype for k, v in loaded.items()})
