"""fuse is the exact inverse of unfuse; state-dict conversion both ways; checkpoints stock diffusers loads."""

import tempfile
import unittest

import torch
from diffusers import Flux2Transformer2DModel
from diffusers.models.transformers.transformer_flux2 import Flux2Attention
from parameterized import parameterized
from safetensors.torch import load_file, save_file

import surgery
from flux2_testing import SMALL_CONFIGS, build, fused_and_copy, inputs, small_config


def assert_same_state(test, actual, expected):
    test.assertEqual(list(actual.keys()), list(expected.keys()))
    for key, value in expected.items():
        test.assertEqual(actual[key].dtype, value.dtype, key)
        test.assertTrue(torch.equal(actual[key], value), key)


class RoundTrip(unittest.TestCase):
    @parameterized.expand([(name,) for name in SMALL_CONFIGS])
    def test_fuse_of_unfuse_is_bitwise(self, name):
        original, model = fused_and_copy(small_config(name), seed=1, dtype=torch.bfloat16)
        surgery.fuse(surgery.unfuse(model))
        assert_same_state(self, model.state_dict(), original.state_dict())
        self.assertEqual([type(m) for m in model.modules()], [type(m) for m in original.modules()])

    def test_fuse_rejoins_views_without_a_copy(self):
        model = build(small_config("klein4b_small"))
        before = model.single_transformer_blocks[0].attn.to_qkv_mlp_proj.weight.data_ptr()
        surgery.fuse(surgery.unfuse(model))
        self.assertEqual(model.single_transformer_blocks[0].attn.to_qkv_mlp_proj.weight.data_ptr(), before)
        ff_records = [r for r in surgery.core.rewrite.last_report(model) if r.before.startswith("Flux2FeedForward")]
        self.assertTrue(ff_records and all(r.bytes_copied == 0 for r in ff_records))

    def test_fuse_on_a_never_unfused_model_is_a_no_op(self):
        model = build(small_config("dev_small"))
        modules = [(n, id(m)) for n, m in model.named_modules()]
        self.assertIs(surgery.fuse(model), model)
        self.assertEqual([(n, id(m)) for n, m in model.named_modules()], modules)

    def test_edits_made_while_unfused_survive(self):
        config = small_config("odd_heads")
        model = build(config)
        surgery.unfuse(model)
        attn, ff = model.single_transformer_blocks[1].attn, model.transformer_blocks[0].ff_context
        with torch.no_grad():
            attn.to_qkv_mlp_proj.k.weight.add_(1.0)  # in place: still a view
            attn.to_out.mlp_part.weight.mul_(2.0)  # a column split, a copy
            ff.linear_in.up.weight = torch.nn.Parameter(torch.randn_like(ff.linear_in.up.weight))  # a new tensor
        # and a real optimizer step on everything
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(**inputs(config), return_dict=False)[0].square().mean().backward()
        optimizer.step()
        expected = surgery.state_dict.fuse_state_dict(model.state_dict(), surgery.state_dict.weight_slices(model))
        surgery.fuse(model, optimizer=optimizer)  # it holds the parts: pass it or be refused
        assert_same_state(self, model.state_dict(), {k: expected[k] for k in model.state_dict()})
        stock = model.single_transformer_blocks[1].attn
        inner = stock.inner_dim
        self.assertTrue(torch.equal(stock.to_qkv_mlp_proj.weight[inner:2 * inner], attn.to_qkv_mlp_proj.k.weight))
        self.assertTrue(torch.equal(stock.to_out.weight[:, inner:], attn.to_out.mlp_part.weight))

    def test_unfuse_train_fuse_save_pretrained_loads_in_stock_diffusers(self):
        config = small_config("klein9b_small")
        model = build(config)
        surgery.unfuse(model)
        with torch.no_grad():
            model.single_transformer_blocks[0].attn.to_qkv_mlp_proj.v.weight.mul_(-1)
        surgery.fuse(model)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            loaded = Flux2Transformer2DModel.from_pretrained(tmp).eval()
        assert_same_state(self, loaded.state_dict(), model.state_dict())
        kw = inputs(config)
        with torch.no_grad():
            self.assertTrue(torch.equal(loaded(**kw).sample, model(**kw).sample))

    def test_fused_qkv_projections_come_back(self):
        original, model = fused_and_copy(small_config("dev_small"))
        original.fuse_qkv_projections()
        model.fuse_qkv_projections()
        surgery.fuse(surgery.unfuse(model))
        attn = model.transformer_blocks[0].attn
        self.assertIs(type(attn), Flux2Attention)
        self.assertTrue(attn.fused_projections)
        self.assertTrue(torch.equal(attn.to_qkv.weight, original.transformer_blocks[0].attn.to_qkv.weight))
        self.assertTrue(torch.equal(attn.to_added_qkv.weight, original.transformer_blocks[0].attn.to_added_qkv.weight))


class StateDictMapping(unittest.TestCase):
    def test_key_map_is_the_same_from_either_form(self):
        model = build(small_config("fractional_mlp"))
        fused_map = surgery.state_dict.weight_slices(model)
        surgery.unfuse(model)
        self.assertEqual(surgery.state_dict.weight_slices(model), fused_map)

    def test_both_ways_bitwise_and_matching_the_modules(self):
        config = small_config("klein4b_small")
        fused, unfused = fused_and_copy(config, seed=2)
        slices = surgery.state_dict.weight_slices(fused)
        surgery.unfuse(unfused)
        converted = surgery.state_dict.unfuse_state_dict(fused.state_dict(), slices)
        assert_same_state(self, {k: converted[k] for k in unfused.state_dict()}, unfused.state_dict())
        self.assertEqual(converted.keys(), unfused.state_dict().keys())
        back = surgery.state_dict.fuse_state_dict(converted, slices)
        assert_same_state(self, {k: back[k] for k in fused.state_dict()}, fused.state_dict())

    def test_unfused_state_dict_saves_as_safetensors(self):
        model = build(small_config("klein4b_small"))
        surgery.unfuse(model)
        with tempfile.TemporaryDirectory() as tmp:
            save_file(model.state_dict(), f"{tmp}/unfused.safetensors")
            loaded = load_file(f"{tmp}/unfused.safetensors")
        assert_same_state(self, {k: loaded[k] for k in model.state_dict()}, model.state_dict())

    def test_missing_key_is_named(self):
        model = build(small_config("klein4b_small"))
        state = model.state_dict()
        del state["single_transformer_blocks.2.attn.to_out.weight"]
        with self.assertRaisesRegex(KeyError, "single_transformer_blocks.2.attn.to_out.weight"):
            surgery.state_dict.unfuse_state_dict(state, surgery.state_dict.weight_slices(model))
