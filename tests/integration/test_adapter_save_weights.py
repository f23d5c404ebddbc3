"""`save_lora_adapter` writes the adapter as it was loaded, whatever weight `set_adapters` gave it, as stock diffusers
does (before: the unfused model's file held the weight in its alphas, 0.069 off when reloaded at weight 1)."""

import copy
import shutil
import tempfile
import unittest
from pathlib import Path

import surgery
from surgery.testing import FP32_TOL
from flux2_testing import build, inputs, rel_err, small_config
from test_diffusers_lora import add_random_adapter, forward, load_like_a_pipeline, save_stock_lora


class SavedAfterSetAdapters(unittest.TestCase):
    def test_the_saved_adapter_is_the_loaded_one(self):
        root = Path(tempfile.mkdtemp(prefix="surgery-lora-weights-"))
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        config = small_config("dev_small")
        base, kw = build(config, 0), inputs(config, 0)
        trained = add_random_adapter(copy.deepcopy(base), "one", 1)
        published = save_stock_lora(trained, "one", root / "published")
        expected = forward(trained, kw)
        for weight in (0.5, 2.0):
            for unfused in (False, True):
                with self.subTest(weight=weight, unfused=unfused):
                    model = surgery.unfuse(copy.deepcopy(base)) if unfused else copy.deepcopy(base)
                    load_like_a_pipeline(model, published, "one")
                    model.set_adapters(["one"], weights=[weight])
                    folder = root / f"saved-{weight}-{unfused}"
                    model.save_lora_adapter(folder, adapter_name="one")
                    reloaded = copy.deepcopy(base)
                    reloaded.load_lora_adapter(folder, adapter_name="again", prefix=None,
                                              weight_name="pytorch_lora_weights.safetensors")
                    self.assertLess(rel_err(forward(reloaded, kw), expected), FP32_TOL)
