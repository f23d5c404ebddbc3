"""HunyuanVideo: what the conformance suite cannot know.

The suite shards only the first test config; here the token-replace (image-to-video) blocks run sharded too. The
processor swap (stock processors reshape by `attn.heads`) is checked both ways, and so is the one gradient that
vanishes mathematically: the token refiner's key bias (softmax is invariant to it, no QK-norm follows `to_k`), whose
values are rounding noise in every model, so it is compared on the scale of the model's gradients.
"""

from __future__ import annotations

import copy
import unittest

import torch
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
from torch.distributed.device_mesh import init_device_mesh

import conformance_worker as W
import surgery
from surgery.core.leaves import head_dim_twin
from surgery.parallel.plans import check_plan

HunyuanVideoHeadDimAttnProcessor = head_dim_twin(HunyuanVideoAttnProcessor2_0)
HunyuanVideoHeadDimRefinerAttnProcessor = head_dim_twin(AttnProcessor2_0)
from surgery.testing import CollectiveCounter, assert_unchanged, rel_err, run_on_cpu_ranks, snapshot

FAMILY = "hunyuan-video"
REFINER_KEY_BIAS = "context_embedder.token_refiner.refiner_blocks.0.attn.to_k.bias"


def gradient_errors(got: dict, ref: dict) -> dict[str, float]:
    """Per parameter: max |got - ref| over the largest reference gradient of its module (its own for a weight; the
    weight's for a bias), so that a mathematically vanishing bias gradient, rounding noise, is compared on the scale
    of its projection's gradients rather than on its own."""
    scale: dict[str, float] = {}
    for n, g in ref.items():
        module = n.rpartition(".")[0]
        scale[module] = max(scale.get(module, 0.0), g.abs().max().item())
    return {n: ((got[n] - g).abs().max() / scale[n.rpartition(".")[0]]).item() for n, g in ref.items()}


def sharded_case(rank: int, world: int, config_name: str, seed: int) -> dict:
    family, config, fused = W.make(FAMILY, config_name, seed)
    kw = W.inputs(family, config, seed)
    model = surgery.tensor_parallel(surgery.unfuse(copy.deepcopy(fused)), init_device_mesh("cpu", (world,)))
    with torch.no_grad(), CollectiveCounter() as counter:
        forward = rel_err(W.output(model, kw), W.output(fused, kw))
    (ref_in, ref), (got_in, got) = W.gradients(fused, kw, seed), W.gradients(model, kw, seed)
    got = surgery.state_dict.fuse_state_dict(got, surgery.state_dict.weight_slices(model))
    return {
        "forward": forward,
        "collectives": dict(counter.counts),
        "expected": family.tp.all_reduces(config),
        "param_grads": gradient_errors(got, ref),
        "input_grads": max(rel_err(got_in[k], g) for k, g in ref_in.items()),
    }


def sharded(rank: int, world: int) -> dict:
    return {name: sharded_case(rank, world, name, seed)
            for seed, name in enumerate(("tp_small", "i2v_token_replace_small"))}


class TensorParallel(unittest.TestCase):
    def test_text_and_token_replace_models_match_the_single_device_fused_model_at_world_2(self):
        for rank, by_config in enumerate(run_on_cpu_ranks(sharded, 2)):
            for name, r in by_config.items():
                where = f"{name}, rank {rank}"
                self.assertLessEqual(r["forward"], W.FP32_TOL, where)
                self.assertEqual(r["collectives"], {"all_reduce": r["expected"]}, where)
                self.assertLessEqual(r["input_grads"], W.FP32_GRAD_TOL, where)
                worst = max(r["param_grads"], key=r["param_grads"].get)
                self.assertLessEqual(r["param_grads"][worst], W.FP32_GRAD_TOL, f"{where}: {worst}")


class Equivalence(unittest.TestCase):
    def test_the_refiner_key_bias_gradient_vanishes_and_every_gradient_matches_on_the_model_scale(self):
        for name in W.families()[FAMILY].tests.configs:
            family, config, fused = W.make(FAMILY, name, 0)
            unfused = surgery.unfuse(copy.deepcopy(fused))
            kw = W.inputs(family, config, 0)
            (_, ref), (_, got) = W.gradients(fused, kw, 0), W.gradients(unfused, kw, 0)
            weight = ref[REFINER_KEY_BIAS.replace("bias", "weight")].abs().max()
            self.assertLess(ref[REFINER_KEY_BIAS].abs().max(), 1e-5 * weight, name)
            errors = gradient_errors(surgery.state_dict.fuse_state_dict(got, surgery.state_dict.weight_slices(unfused)), ref)
            self.assertLessEqual(max(errors.values()), W.FP32_GRAD_TOL, name)


class Processors(unittest.TestCase):
    def test_unfuse_installs_head_dim_twins_and_fuse_restores_stock_processors(self):
        family, config, fused = W.make(FAMILY, "i2v_token_replace_small")
        fused.transformer_blocks[0].attn.processor._attention_backend = "native"
        model = surgery.unfuse(copy.deepcopy(fused))
        attentions = {n: m for n, m in model.named_modules() if isinstance(m, Attention)}
        self.assertTrue(all(type(m) is Attention for m in attentions.values()))  # diffusers' class stays
        refiner = {n for n in attentions if "refiner" in n}
        for name, attn in attentions.items():
            expected = HunyuanVideoHeadDimRefinerAttnProcessor if name in refiner else HunyuanVideoHeadDimAttnProcessor
            self.assertIs(type(attn.processor), expected, name)
        self.assertEqual(model.transformer_blocks[0].attn.processor._attention_backend, "native")

        model.single_transformer_blocks[0].attn.set_processor(HunyuanVideoAttnProcessor2_0())  # a stock one
        with self.assertRaisesRegex(surgery.SurgeryError, "still a fused"):  # sharding it would be wrong: refused
            check_plan(model, [], 2)  # what tensor_parallel checks first
        surgery.unfuse(model)  # swaps just that processor
        self.assertIs(type(model.single_transformer_blocks[0].attn.processor), HunyuanVideoHeadDimAttnProcessor)

        surgery.fuse(model)
        for name, attn in model.named_modules():
            if isinstance(attn, Attention):
                self.assertIs(type(attn), Attention, name)
                expected = AttnProcessor2_0 if "refiner" in name else HunyuanVideoAttnProcessor2_0
                self.assertIs(type(attn.processor), expected, name)
        self.assertEqual(model.transformer_blocks[0].attn.processor._attention_backend, "native")

    def test_a_custom_processor_is_left_alone(self):
        class Custom(HunyuanVideoAttnProcessor2_0):
            pass

        _, _, model = W.make(FAMILY, "tp_small")
        model.transformer_blocks[0].attn.set_processor(Custom())
        surgery.unfuse(model)
        self.assertIs(type(model.transformer_blocks[0].attn.processor), Custom)

    def test_the_refiner_twin_broadcasts_a_per_sample_mask_over_the_heads(self):
        _, _, model = W.make(FAMILY, "tp_small")
        attn = surgery.unfuse(model).context_embedder.token_refiner.refiner_blocks[0].attn
        x = torch.randn(2, 5, attn.query_dim)
        per_sample = torch.ones(2, 1, 5, 5, dtype=torch.bool)
        per_sample[0, ..., 3:] = False
        stock = AttnProcessor2_0()(attn, x, attention_mask=per_sample)
        torch.testing.assert_close(attn(x, attention_mask=per_sample), stock, rtol=0, atol=1e-6)


if __name__ == "__main__":
    unittest.main()
