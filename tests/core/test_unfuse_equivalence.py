"""The unfused model computes what the fused one does: forward and backward, fp32 tight, bf16 loose."""

import unittest

import torch
from parameterized import parameterized

import surgery
from flux2_testing import SMALL_CONFIGS, fused_and_copy, inputs, rel_err, small_config, use_kv_processors

from surgery.testing import BF16_TOL, FP32_GRAD_TOL, FP32_TOL
CASES = [(name, seed) for name in SMALL_CONFIGS for seed in (0, 1)]


def forward(model, kw):
    return model(**kw, return_dict=False)[0]


class ForwardEquivalence(unittest.TestCase):
    @parameterized.expand(CASES)
    def test_fp32(self, name, seed):
        config = small_config(name)
        fused, unfused = fused_and_copy(config, seed)
        surgery.unfuse(unfused)
        kw = inputs(config, seed)
        with torch.no_grad():
            self.assertLessEqual(rel_err(forward(unfused, kw), forward(fused, kw)), FP32_TOL)

    @parameterized.expand([(name,) for name in SMALL_CONFIGS])
    def test_bf16(self, name):
        config = small_config(name)
        fused, unfused = fused_and_copy(config, seed=3, dtype=torch.bfloat16)
        surgery.unfuse(unfused)
        self.assertTrue(all(p.dtype == torch.bfloat16 for p in unfused.parameters()))
        kw = inputs(config, seed=3, dtype=torch.bfloat16)
        with torch.no_grad():
            self.assertLessEqual(rel_err(forward(unfused, kw), forward(fused, kw)), BF16_TOL)

    @parameterized.expand([(1, 4, 9), (3, 7, 5)])
    def test_batch_and_lengths(self, batch, image_tokens, text_tokens):
        config = small_config("odd_heads")
        fused, unfused = fused_and_copy(config, seed=5)
        surgery.unfuse(unfused)
        kw = inputs(config, seed=5, batch=batch, image_tokens=image_tokens, text_tokens=text_tokens)
        with torch.no_grad():
            self.assertLessEqual(rel_err(forward(unfused, kw), forward(fused, kw)), FP32_TOL)

    def test_guidance_off_on_a_guidance_model(self):
        config = small_config("dev_small")
        fused, unfused = fused_and_copy(config, seed=2)
        surgery.unfuse(unfused)
        kw = dict(inputs(config, seed=2), guidance=None)
        with torch.no_grad():
            self.assertLessEqual(rel_err(forward(unfused, kw), forward(fused, kw)), FP32_TOL)

    def test_attention_mask(self):
        config = small_config("klein9b_small")
        fused, unfused = fused_and_copy(config, seed=4)
        surgery.unfuse(unfused)
        kw = inputs(config, seed=4)
        batch, text, image = 2, kw["txt_ids"].shape[0], kw["img_ids"].shape[0]
        mask = torch.ones(batch, 1, 1, text + image, dtype=torch.bool)
        mask[1, ..., 2:text] = False  # second prompt is padded after two tokens
        kw["joint_attention_kwargs"] = {"attention_mask": mask}
        with torch.no_grad():
            masked = forward(fused, kw)
            self.assertLessEqual(rel_err(forward(unfused, kw), masked), FP32_TOL)
            self.assertGreater(rel_err(masked, forward(fused, dict(kw, joint_attention_kwargs=None))), 1e-3)

    def test_fused_qkv_projections(self):
        config = small_config("klein4b_small")
        fused, unfused = fused_and_copy(config, seed=6)
        fused.fuse_qkv_projections()
        unfused.fuse_qkv_projections()
        surgery.unfuse(unfused)
        self.assertFalse(any(n.endswith(("to_qkv", "to_added_qkv")) for n, _ in unfused.named_modules()))
        kw = inputs(config, seed=6)
        with torch.no_grad():
            self.assertLessEqual(rel_err(forward(unfused, kw), forward(fused, kw)), FP32_TOL)


class BackwardEquivalence(unittest.TestCase):
    @parameterized.expand([("klein4b_small", 0), ("dev_small", 1), ("fractional_mlp", 2), ("odd_heads", 3)])
    def test_grads_of_inputs_and_every_parameter(self, name, seed):
        config = small_config(name)
        fused, unfused = fused_and_copy(config, seed)
        surgery.unfuse(unfused)
        grads = []
        for model in (fused, unfused):
            kw = inputs(config, seed)
            kw["hidden_states"].requires_grad_(True)
            kw["encoder_hidden_states"].requires_grad_(True)
            out = forward(model, kw)
            weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
            (out * weight).sum().backward()
            grads.append((kw["hidden_states"].grad, kw["encoder_hidden_states"].grad,
                          {n: p.grad for n, p in model.named_parameters()}))
        (hs, ehs, fused_grads), (u_hs, u_ehs, unfused_grads) = grads
        self.assertLessEqual(rel_err(u_hs, hs), FP32_TOL)
        self.assertLessEqual(rel_err(u_ehs, ehs), FP32_TOL)
        mapped = surgery.state_dict.fuse_state_dict(unfused_grads, surgery.state_dict.weight_slices(unfused))
        self.assertEqual(mapped.keys(), fused_grads.keys())
        for key, grad in fused_grads.items():
            self.assertLessEqual(rel_err(mapped[key], grad), FP32_GRAD_TOL, key)

    def test_gradient_checkpointing(self):
        config = small_config("klein9b_small")
        fused, unfused = fused_and_copy(config, seed=7)
        surgery.unfuse(unfused)
        unfused.enable_gradient_checkpointing()
        unfused.train()
        fused.train()
        results = []
        for model in (fused, unfused):
            kw = inputs(config, seed=7)
            forward(model, kw).square().mean().backward()
            results.append({n: p.grad for n, p in model.named_parameters()})
        mapped = surgery.state_dict.fuse_state_dict(results[1], surgery.state_dict.weight_slices(unfused))
        for key, grad in results[0].items():
            self.assertLessEqual(rel_err(mapped[key], grad), FP32_GRAD_TOL, key)


class KVCacheEquivalence(unittest.TestCase):
    """Klein KV: `extract` on [ref, img] tokens stores per-layer ref K/V; `cached` reuses them on img tokens."""

    @parameterized.expand([("klein4b_small", 0), ("klein9b_small", 1)])
    def test_extract_then_cached(self, name, seed):
        config = small_config(name)
        fused, unfused = fused_and_copy(config, seed)
        surgery.unfuse(unfused)
        use_kv_processors(fused)
        use_kv_processors(unfused)
        num_ref = 4
        extract = inputs(config, seed, image_tokens=10 + num_ref)
        cached = {k: v for k, v in inputs(config, seed + 10).items()}
        outputs = []
        with torch.no_grad():
            for model in (fused, unfused):
                out, cache = model(**extract, kv_cache_mode="extract", num_ref_tokens=num_ref, ref_fixed_timestep=0.0,
                                   return_dict=False)
                again = forward(model, dict(cached, kv_cache=cache, kv_cache_mode="cached"))
                outputs.append((out, cache, again))
        (out, cache, again), (u_out, u_cache, u_again) = outputs
        self.assertLessEqual(rel_err(u_out, out), FP32_TOL)
        self.assertLessEqual(rel_err(u_again, again), FP32_TOL)
        for layers, u_layers in ((cache.double_block_caches, u_cache.double_block_caches),
                                 (cache.single_block_caches, u_cache.single_block_caches)):
            for layer, u_layer in zip(layers, u_layers):
                self.assertLessEqual(rel_err(u_layer.k_ref, layer.k_ref), FP32_TOL)
                self.assertLessEqual(rel_err(u_layer.v_ref, layer.v_ref), FP32_TOL)
