"""`surgery.save_pretrained(torch.compile(model))` writes the stock checkpoint of the model the compile wraps (before:
every key as `_orig_mod.*`, and stock `from_pretrained` newly initialised every weight)."""

import shutil
import tempfile
import unittest
from pathlib import Path

import torch
from diffusers import Flux2Transformer2DModel

import surgery
from flux2_testing import build, small_config

CONFIG = small_config("tp_wide")


class CompiledModel(unittest.TestCase):
    def test_stock_from_pretrained_loads_every_weight(self):
        root = Path(tempfile.mkdtemp(prefix="surgery-compiled-"))
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        for unfused in (False, True):
            with self.subTest(unfused=unfused):
                model = build(CONFIG, seed=3)
                surgery.save_pretrained(torch.compile(surgery.unfuse(model) if unfused else model), root / "model")
                loaded, info = Flux2Transformer2DModel.from_pretrained(root / "model", output_loading_info=True)
                self.assertEqual({k: v for k, v in info.items() if v}, {})
                expected = build(CONFIG, seed=3).state_dict()
                got = loaded.state_dict()
                self.assertEqual(got.keys(), expected.keys())
                self.assertEqual([k for k, v in expected.items() if not torch.equal(got[k], v)], [])
