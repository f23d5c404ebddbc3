"""LoRA as diffusers users do it, on the unfused model: adapters in stock FLUX.2 names load, mix, merge and save."""

import copy
import shutil
import tempfile
import unittest
from pathlib import Path

import torch
from diffusers import Flux2Pipeline
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

import surgery
from flux2_testing import STOCK_TARGETS, add_random_adapter, build, forward, inputs, rel_err, small_config

from surgery.testing import FP32_TOL
# every Linear of the blocks by its stock name, the fused projections included (a regex, as PEFT takes it)
def save_stock_lora(model, name: str, folder: Path) -> Path:
    """What a stock user publishes: diffusers' `save_lora_weights` with the adapter's config."""
    Flux2Pipeline.save_lora_weights(
        folder, transformer_lora_layers=get_peft_model_state_dict(model, adapter_name=name),
        transformer_lora_adapter_metadata=model.peft_config[name].to_dict(),
    )
    return folder


def load_like_a_pipeline(transformer, folder: Path, name: str, **kw):
    """What `pipe.load_lora_weights(folder, adapter_name=name)` runs, without the rest of the pipeline."""
    state_dict, metadata = Flux2Pipeline.lora_state_dict(folder, return_lora_metadata=True)
    Flux2Pipeline.load_lora_into_transformer(state_dict, transformer=transformer, adapter_name=name,
                                             metadata=metadata, **kw)


class StockAdapterOnUnfusedModel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = Path(tempfile.mkdtemp(prefix="surgery-lora-"))
        cls.config = small_config("dev_small")
        cls.base = build(cls.config, 0)
        cls.kw = inputs(cls.config, 0)
        cls.trained = add_random_adapter(copy.deepcopy(cls.base), "one", 1)
        add_random_adapter(cls.trained, "two", 2, rank=2, alpha=2, targets=["to_qkv_mlp_proj", "linear_in"])
        cls.files = {n: save_stock_lora(cls.trained, n, cls.root / n) for n in ("one", "two")}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root, ignore_errors=True)

    def both(self):
        """A stock and an unfused transformer, each with both published adapters loaded the pipeline's way."""
        models = copy.deepcopy(self.base), surgery.unfuse(copy.deepcopy(self.base))
        for model in models:
            for name, folder in self.files.items():
                load_like_a_pipeline(model, folder, name)
        return models

    def assert_same(self, stock, unfused, reference=None):
        expected = forward(stock, self.kw)
        self.assertLessEqual(rel_err(forward(unfused, self.kw), expected), FP32_TOL)
        if reference is not None:
            self.assertLessEqual(rel_err(expected, reference), FP32_TOL)

    def test_published_adapter_gives_the_trained_models_outputs(self):
        stock, unfused = self.both()
        self.trained.set_adapters(["one"])
        for model in (stock, unfused):
            model.set_adapters(["one"])
        self.assert_same(stock, unfused, forward(self.trained, self.kw))
        attn = unfused.single_transformer_blocks[0].attn
        stock_attn = stock.single_transformer_blocks[0].attn
        self.assertTrue(torch.equal(attn.to_qkv_mlp_proj.k.lora_A["one"].weight,
                                    stock_attn.to_qkv_mlp_proj.lora_A["one"].weight))
        self.assertTrue(torch.equal(attn.to_out.mlp_part.lora_A["one"].weight,
                                    stock_attn.to_out.lora_A["one"].weight[:, attn.inner_dim:]))

    def test_set_adapters_with_weights_fuse_unfuse_and_unload(self):
        stock, unfused = self.both()
        for model in (stock, unfused):
            model.set_adapters(["one", "two"], weights=[0.7, -0.4])
        self.assert_same(stock, unfused)
        for model in (stock, unfused):
            model.fuse_lora(lora_scale=0.5, adapter_names=["one", "two"])
        self.assert_same(stock, unfused)
        for model in (stock, unfused):
            model.unfuse_lora()
            model.set_adapters(["two"])
        self.assert_same(stock, unfused)
        for model in (stock, unfused):
            model.unload_lora()
        self.assert_same(stock, unfused, forward(self.base, self.kw))
        surgery.fuse(unfused)  # plain Linears again: the stock model's weights (fuse_lora + unfuse_lora round)
        self.assertEqual(unfused.state_dict().keys(), stock.state_dict().keys())
        for key, value in stock.state_dict().items():
            torch.testing.assert_close(unfused.state_dict()[key], value, rtol=1e-6, atol=1e-7, msg=key)

    def test_hotswap(self):
        stock, unfused = copy.deepcopy(self.base), surgery.unfuse(copy.deepcopy(self.base))
        other = add_random_adapter(copy.deepcopy(self.base), "one", 7)
        swap = save_stock_lora(other, "one", self.root / "swap")
        for model in (stock, unfused):
            load_like_a_pipeline(model, self.files["one"], "one")
            load_like_a_pipeline(model, swap, "one", hotswap=True)
        self.assert_same(stock, unfused, forward(other, self.kw))

    def test_model_level_load_from_a_folder(self):
        unfused = surgery.unfuse(copy.deepcopy(self.base))
        unfused.load_lora_adapter(self.files["one"], prefix="transformer", adapter_name="one",
                                  weight_name="pytorch_lora_weights.safetensors")
        self.trained.set_adapters(["one"])
        self.assertLessEqual(rel_err(forward(unfused, self.kw), forward(self.trained, self.kw)), FP32_TOL)


    def test_ai_toolkit_format_converted_by_diffusers(self):
        adapter = get_peft_model_state_dict(self.trained, adapter_name="one")
        names = {"to_qkv_mlp_proj": "linear1", "to_out": "linear2"}
        published = {}
        for key, value in adapter.items():
            parts = key.split(".")  # single_transformer_blocks.<i>.attn.<name>.lora_X.weight
            if parts[0] == "single_transformer_blocks":
                published[f"diffusion_model.single_blocks.{parts[1]}.{names[parts[3]]}.{parts[4]}.weight"] = value
        save_file(published, self.root / "ai-toolkit.safetensors")
        stock, unfused = copy.deepcopy(self.base), surgery.unfuse(copy.deepcopy(self.base))
        for model in (stock, unfused):
            state_dict = Flux2Pipeline.lora_state_dict(self.root / "ai-toolkit.safetensors")
            Flux2Pipeline.load_lora_into_transformer(state_dict, transformer=model, adapter_name="t")
        self.assert_same(stock, unfused)
        self.assertGreater(rel_err(forward(stock, self.kw), forward(self.base, self.kw)), 1e-3)  # it does something

    def test_adapters_that_cannot_be_split_are_refused(self):
        unfused = surgery.unfuse(copy.deepcopy(self.base))
        adapter = get_peft_model_state_dict(self.trained, adapter_name="one")
        adapter = {f"transformer.{k}": v for k, v in adapter.items()}
        key = "transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_magnitude_vector"
        with self.assertRaisesRegex(surgery.SurgeryError, "not a plain LoRA factor") as error:
            unfused.load_lora_adapter({**adapter, key: torch.ones(3)}, adapter_name="d")
        self.assertFalse(hasattr(unfused, "peft_config"))
        print(f"\n{error.exception}")


class AdapterTrainedOnUnfusedModel(unittest.TestCase):
    def test_targets_and_saved_names_are_stock(self):
        config = small_config("klein9b_small")
        base = build(config, 3)
        kw = inputs(config, 3)
        unfused = surgery.unfuse(copy.deepcopy(base))
        targets = surgery.lora.lora_target_modules(unfused, STOCK_TARGETS)
        self.assertIn("single_transformer_blocks.0.attn.to_out.mlp_part", targets)
        stock_model = add_random_adapter(copy.deepcopy(base), "x", 0)
        add_random_adapter(unfused, "x", 4, targets=targets, rank=4, alpha=8)
        # the same stock layers get an adapter: map each unfused LoRA layer back to the stock layer it is part of
        stock_of = {s.unfused.rsplit(".", 1)[0]: s.fused.rsplit(".", 1)[0] for s in surgery.state_dict.weight_slices(unfused)}
        lora_layers = lambda m: {n for n, mod in m.named_modules() if hasattr(mod, "lora_A")}  # noqa: E731
        self.assertEqual({stock_of.get(n, n) for n in lora_layers(unfused)}, lora_layers(stock_model))

        folder = Path(tempfile.mkdtemp(prefix="surgery-lora-"))
        try:
            unfused.save_lora_adapter(folder, adapter_name="x")  # stock names, stock config
            stock = copy.deepcopy(base)
            stock.load_lora_adapter(folder, prefix=None, adapter_name="x",
                                    weight_name="pytorch_lora_weights.safetensors")
            self.assertLessEqual(rel_err(forward(stock, kw), forward(unfused, kw)), FP32_TOL)
            self.assertIn("single_transformer_blocks.0.attn.to_qkv_mlp_proj", stock.peft_config["x"].target_modules)

            layers, metadata = surgery.lora.stock_lora_adapter(unfused, "x")
            Flux2Pipeline.save_lora_weights(folder / "pipe", transformer_lora_layers=layers,
                                            transformer_lora_adapter_metadata=metadata)
            again = copy.deepcopy(base)
            load_like_a_pipeline(again, folder / "pipe", "x")
            self.assertLessEqual(rel_err(forward(again, kw), forward(unfused, kw)), FP32_TOL)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def test_adapter_saved_with_plain_peft_from_the_unfused_model_loads_back(self):
        # issue 18: an adapter in the unfused names (PEFT's own state dict of the unfused model) is loaded as it is
        config = small_config("klein9b_small")
        base = build(config, 3)
        kw = inputs(config, 3)
        trained = surgery.unfuse(copy.deepcopy(base))
        add_random_adapter(trained, "x", 4, targets=surgery.lora.lora_target_modules(trained, STOCK_TARGETS))
        layers = get_peft_model_state_dict(trained, adapter_name="x")
        # the unfused names, which no stock model has: the adapter is loaded as it is, not split
        self.assertIn("single_transformer_blocks.0.attn.to_out.attn_part.lora_A.weight", layers)
        self.assertIn("single_transformer_blocks.0.attn.to_qkv_mlp_proj.q.lora_A.weight", layers)
        folder = Path(tempfile.mkdtemp(prefix="surgery-lora-"))
        try:
            Flux2Pipeline.save_lora_weights(folder, transformer_lora_layers=layers,
                                            transformer_lora_adapter_metadata=trained.peft_config["x"].to_dict())
            for how in ("pipeline", "model"):
                again = surgery.unfuse(copy.deepcopy(base))
                if how == "pipeline":
                    load_like_a_pipeline(again, folder, "x")
                else:
                    again.load_lora_adapter(folder, adapter_name="x", weight_name="pytorch_lora_weights.safetensors")
                self.assertLessEqual(rel_err(forward(again, kw), forward(trained, kw)), FP32_TOL, how)
            self.assertGreater(rel_err(forward(trained, kw), forward(base, kw)), 1e-3)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def test_stock_targets_that_match_nothing_are_refused(self):
        unfused = surgery.unfuse(build(small_config("klein9b_small"), 0))
        with self.assertRaisesRegex(surgery.SurgeryError, "selects no Linear"):
            surgery.lora.lora_target_modules(unfused, ["to_nothing"])


class AdapterWhosePartsScaleDifferently(unittest.TestCase):
    """An adapter trained on the unfused model whose parts of one stock module have their own alpha or rank, or use
    rsLoRA (alpha / sqrt(r)), published with `stock_lora_adapter`: the stock model that loads it gives the same
    output. The parts' scales are what the stock file must carry (in alpha_pattern or folded into lora_B)."""

    @classmethod
    def setUpClass(cls):
        cls.config = small_config("klein9b_small")
        cls.base = build(cls.config, 3)
        cls.kw = inputs(cls.config, 3)

    def published_and_reloaded(self, **lora):
        from surgery.integration.lora import lora_target_modules, stock_lora_adapter

        unfused = surgery.unfuse(copy.deepcopy(self.base))
        add_random_adapter(unfused, "x", 5, targets=lora_target_modules(unfused, STOCK_TARGETS), **lora)
        layers, metadata = stock_lora_adapter(unfused, "x")
        folder = Path(tempfile.mkdtemp(prefix="surgery-lora-"))
        try:
            Flux2Pipeline.save_lora_weights(folder, transformer_lora_layers=layers,
                                            transformer_lora_adapter_metadata=metadata)
            stock = copy.deepcopy(self.base)
            load_like_a_pipeline(stock, folder, "x")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.assertIn("single_transformer_blocks.0.attn.to_qkv_mlp_proj", stock.peft_config["x"].target_modules)
        # the adapter moves the output well beyond the tolerance, so a wrong scale cannot hide
        self.assertGreater(rel_err(forward(unfused, self.kw), forward(self.base, self.kw)), 1e-2)
        self.assertLessEqual(rel_err(forward(stock, self.kw), forward(unfused, self.kw)), FP32_TOL)

    def test_parts_with_their_own_alpha(self):
        # the single block's q and the double block's to_k differ from their siblings in one fused module each
        self.published_and_reloaded(alpha_pattern={"to_qkv_mlp_proj.q": 32, "attn.to_k": 2})

    def test_parts_with_their_own_rank(self):
        self.published_and_reloaded(rank_pattern={"to_qkv_mlp_proj.gate": 2, "attn.to_v": 6})

    def test_rslora(self):
        self.published_and_reloaded(use_rslora=True, rank=16, alpha=8)


class SplitFunction(unittest.TestCase):
    def setUp(self):
        self.base = build(small_config("klein4b_small"), 0)
        self.slices = surgery.state_dict.weight_slices(self.base)
        model = add_random_adapter(copy.deepcopy(self.base), "a", 0)
        self.adapter = get_peft_model_state_dict(model, adapter_name="a")

    def test_prefixed_keys_are_split_and_keep_their_prefix(self):
        plain = surgery.lora.unfuse_lora_state_dict(self.adapter, self.slices)
        prefixed = surgery.lora.unfuse_lora_state_dict(
            {**{f"transformer.{k}": v for k, v in self.adapter.items()}, "text_encoder.x.lora_A.weight": torch.ones(1)},
            self.slices,
        )
        self.assertEqual(set(prefixed), {f"transformer.{k}" for k in plain} | {"text_encoder.x.lora_A.weight"})
        for key, value in plain.items():
            self.assertTrue(torch.equal(prefixed[f"transformer.{key}"], value), key)

    def test_an_adapter_on_no_fused_module_is_refused(self):
        with self.assertRaisesRegex(surgery.SurgeryError, "none of the adapter's"):
            surgery.lora.unfuse_lora_state_dict({"foo.to_q.lora_A.weight": torch.ones(1, 1),
                                            "foo.to_q.lora_B.weight": torch.ones(1, 1)}, self.slices)
        split = surgery.lora.unfuse_lora_state_dict(self.adapter, self.slices)
        with self.assertRaisesRegex(surgery.SurgeryError, "already in the unfused layout"):
            surgery.lora.unfuse_lora_state_dict(split, self.slices)


if __name__ == "__main__":
    unittest.main()
