"""A LoRA trained on the fused names works on the unfused model (split along the same rows/columns) and merges back."""

import copy
import unittest

import torch
from parameterized import parameterized
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict

import surgery
from surgery.testing import FP32_TOL
from flux2_testing import build, inputs, rel_err, small_config

# the fused projections (the single block's to_out is a Linear; the double block's is a ModuleList), plus two
# double-stream projections that unfuse leaves alone
FUSED_TARGETS = r".*(to_qkv_mlp_proj|single_transformer_blocks\.\d+\.attn\.to_out|linear_in|attn\.to_q|add_k_proj)$"


def with_random_lora(model, targets, seed, rank=4):
    """Inject a LoRA with random (not zero) factors, as after training."""
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets), model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def load_adapter(model, adapter: dict):
    targets = sorted({k.rsplit(".lora_", 1)[0] for k in adapter})
    rank_pattern = {k.rsplit(".lora_", 1)[0]: v.shape[0] for k, v in adapter.items() if ".lora_A." in k}
    config = LoraConfig(r=4, lora_alpha=4, target_modules=targets, rank_pattern=rank_pattern,
                        alpha_pattern=rank_pattern)
    inject_adapter_in_model(config, model)
    result = set_peft_model_state_dict(model, adapter)
    assert not [k for k in result.unexpected_keys if "lora_" in k], result.unexpected_keys
    return model


def forward(model, kw):
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]


class SplitAdapter(unittest.TestCase):
    @parameterized.expand([("klein4b_small", 0), ("odd_heads", 1), ("fractional_mlp", 2)])
    def test_unfused_model_with_split_adapter_equals_fused_with_adapter(self, name, seed):
        config = small_config(name)
        base = build(config, seed)
        fused = with_random_lora(copy.deepcopy(base), FUSED_TARGETS, seed)
        adapter = get_peft_model_state_dict(fused)
        slices = surgery.state_dict.weight_slices(base)
        split = surgery.lora.unfuse_lora_state_dict(adapter, slices)
        self.assertIn("single_transformer_blocks.0.attn.to_out.mlp_part.lora_A.weight", split)
        self.assertNotIn("single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_A.weight", split)
        unfused = load_adapter(surgery.unfuse(copy.deepcopy(base)), split)
        kw = inputs(config, seed)
        self.assertLessEqual(rel_err(forward(unfused, kw), forward(fused, kw)), FP32_TOL)

        back = surgery.lora.fuse_lora_state_dict(split, slices)
        self.assertEqual(back.keys(), adapter.keys())
        for key, value in adapter.items():
            self.assertTrue(torch.equal(back[key], value), key)

    def test_adapter_trained_after_the_split_joins_exactly(self):
        config = small_config("klein9b_small")
        base = build(config, 3)
        slices = surgery.state_dict.weight_slices(base)
        targets = [f"single_transformer_blocks.1.attn.to_qkv_mlp_proj.{p}" for p in ("q", "k", "v", "gate", "up")] + [
            "single_transformer_blocks.1.attn.to_out.attn_part", "single_transformer_blocks.1.attn.to_out.mlp_part"]
        unfused = with_random_lora(surgery.unfuse(copy.deepcopy(base)), targets, 4)  # independent factors per part
        joined = surgery.lora.fuse_lora_state_dict(get_peft_model_state_dict(unfused), slices)
        self.assertEqual(joined["single_transformer_blocks.1.attn.to_qkv_mlp_proj.lora_A.weight"].shape[0], 4 * 5)
        fused = load_adapter(copy.deepcopy(base), joined)
        kw = inputs(config, 3)
        self.assertLessEqual(rel_err(forward(unfused, kw), forward(fused, kw)), FP32_TOL)

    def test_merge_then_fuse_equals_the_fused_model_with_the_adapter_merged(self):
        config = small_config("dev_small")
        base = build(config, 5)
        fused = with_random_lora(copy.deepcopy(base), FUSED_TARGETS, 5)
        split = surgery.lora.unfuse_lora_state_dict(get_peft_model_state_dict(fused), surgery.state_dict.weight_slices(base))
        unfused = load_adapter(surgery.unfuse(copy.deepcopy(base)), split)
        fused.fuse_lora()
        fused.unload_lora()
        unfused.fuse_lora()
        unfused.unload_lora()
        surgery.fuse(unfused)
        merged = unfused.state_dict()
        self.assertEqual(merged.keys(), fused.state_dict().keys())
        for key, value in fused.state_dict().items():
            torch.testing.assert_close(merged[key], value, rtol=1e-6, atol=1e-7, msg=key)

    def test_dora_is_refused_on_split_modules_only(self):
        slices = [surgery.extend.Slice("qkv.weight", "q.weight", 0, 0, 2), surgery.extend.Slice("qkv.weight", "k.weight", 0, 2, 4)]
        factors = {"qkv.lora_A.weight": torch.ones(1, 3), "qkv.lora_B.weight": torch.ones(4, 1)}
        with self.assertRaisesRegex(surgery.SurgeryError, "DoRA magnitudes"):
            surgery.lora.unfuse_lora_state_dict({**factors, "qkv.lora_magnitude_vector": torch.ones(4)}, slices)
        # a DoRA magnitude or LoRA bias on a module that unfuse never touches passes through, both ways
        extra = {"out.lora_magnitude_vector": torch.ones(3), "out.lora_B.bias": torch.ones(3)}
        split = surgery.lora.unfuse_lora_state_dict({**factors, **extra}, slices)
        self.assertEqual(sorted(split), sorted(["k.lora_A.weight", "k.lora_B.weight", "q.lora_A.weight",
                                                "q.lora_B.weight", *extra]))
        self.assertEqual(sorted(surgery.lora.fuse_lora_state_dict(split, slices)), sorted([*factors, *extra]))
        with self.assertRaisesRegex(surgery.SurgeryError, "DoRA magnitudes"):
            surgery.lora.fuse_lora_state_dict({**split, "q.lora_B.bias": torch.ones(2)}, slices)
