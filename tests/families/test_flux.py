"""FLUX.1 behaviour the conformance suite cannot know: `fuse_qkv_projections()` (on every `FluxAttention`, the
single-stream blocks' too, so also Chroma's), and the IP-Adapter processor, which cannot run sharded."""

from __future__ import annotations

import copy
import unittest

import torch
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxIPAdapterAttnProcessor
from parameterized import parameterized
from torch.distributed.device_mesh import init_device_mesh

import conformance_worker as W
import surgery
from surgery_rewrites.flux import FluxSplitQKVAttention
from surgery.parallel.distributed import fake_process_group
from surgery.testing import assert_unchanged, rel_err, snapshot
from surgery.core.walk import find_modules

CASES = [("flux1", "tp_dev"), ("chroma", "tp_hd")]


def _attentions(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, FluxAttention)]


class FusedQKV(unittest.TestCase):
    @parameterized.expand(CASES)
    def test_unfuse_splits_every_fused_qkv_and_fuse_restores_it(self, family_name, config_name):
        family, config, model = W.make(family_name, config_name, seed=3)
        model.fuse_qkv_projections()
        self.assertTrue(all(m.fused_projections for _, m in _attentions(model)))
        fused = copy.deepcopy(model)
        kw = W.inputs(family, config, seed=3)
        with torch.no_grad():
            expected = W.output(fused, kw)

            unfused = surgery.unfuse(model)
            attentions = _attentions(unfused)
            self.assertEqual(len(attentions), config["num_layers"] + config["num_single_layers"])
            for name, attn in attentions:  # double- and single-block attentions alike, in one call
                self.assertIs(type(attn), FluxSplitQKVAttention, name)
                self.assertFalse(hasattr(attn, "to_qkv") or hasattr(attn, "to_added_qkv"), name)
                self.assertFalse(attn.fused_projections, name)
                # row slices of to_qkv are views of its storage
                self.assertEqual(attn.to_k.weight.untyped_storage().data_ptr(),
                                 attn.to_q.weight.untyped_storage().data_ptr(), name)
            self.assertEqual(find_modules(unfused, fused=True), [])
            self.assertLessEqual(rel_err(W.output(unfused, kw), expected), W.FP32_TOL)
            # checkpoints never hold to_qkv: the key map leaves q/k/v keys as they are
            self.assertFalse(any("qkv" in s.fused for s in surgery.state_dict.weight_slices(unfused)))

            back = surgery.fuse(unfused)
        self.assertEqual([(n, type(m)) for n, m in back.named_modules()],
                         [(n, type(m)) for n, m in fused.named_modules()])
        for name, attn in _attentions(back):
            self.assertTrue(attn.fused_projections, name)
        state, original = back.state_dict(), fused.state_dict()
        self.assertEqual(list(state), list(original))
        self.assertTrue(any(k.endswith("to_qkv.weight") for k in state))
        self.assertTrue(any(k.endswith("to_added_qkv.weight") for k in state))
        for key, value in original.items():
            self.assertTrue(torch.equal(state[key], value), key)
        with torch.no_grad():
            self.assertEqual(rel_err(W.output(back, kw), expected), 0.0)

    @parameterized.expand(CASES)
    def test_builders_never_mutate_a_qkv_fused_block(self, family_name, config_name):
        _, _, model = W.make(family_name, config_name)
        model.fuse_qkv_projections()
        unfused = surgery.unfuse(copy.deepcopy(model))
        for form, is_fused in ((model, True), (unfused, False)):
            for path, module, rewrite in find_modules(form, fused=is_fused):
                snap = snapshot(module)
                attributes = {k: v for k, v in vars(module).items() if not k.startswith("_")}
                (rewrite.build_unfused if is_fused else rewrite.build_fused)(module)
                assert_unchanged(module, snap)
                self.assertEqual({k: v for k, v in vars(module).items() if not k.startswith("_")}, attributes, path)


    def test_a_hook_on_a_nested_to_qkv_is_refused_before_anything_changes(self):
        _, _, model = W.make("flux1", "tp_dev")
        model.fuse_qkv_projections()
        model.single_transformer_blocks[1].attn.to_qkv.register_forward_hook(lambda *args: None)
        snap = snapshot(model)
        with self.assertRaisesRegex(surgery.SurgeryError, r"'single_transformer_blocks\.1\.attn\.to_qkv'"):
            surgery.unfuse(model)
        assert_unchanged(model, snap)
        self.assertIs(type(model.transformer_blocks[0].attn), FluxAttention)


class Processors(unittest.TestCase):
    def test_tensor_parallel_refuses_the_ip_adapter_processor_before_changing_anything(self):
        _, _, model = W.make("flux1", "tp_dev")
        surgery.unfuse(model)
        dim = model.config.num_attention_heads * model.config.attention_head_dim
        model.transformer_blocks[0].attn.set_processor(FluxIPAdapterAttnProcessor(dim, 8))
        snap = snapshot(model)
        with fake_process_group(2):
            with self.assertRaisesRegex(surgery.SurgeryError, r"'transformer_blocks\.0\.attn' uses FluxIPAdapter"):
                surgery.tensor_parallel(model, init_device_mesh("cpu", (2,)), src_data_rank=None)
        assert_unchanged(model, snap)


if __name__ == "__main__":
    unittest.main()
