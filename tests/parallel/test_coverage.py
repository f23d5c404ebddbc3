"""No silent half-shard: `tensor_parallel` with the registered plans refuses a model whose transformer blocks hold a
Linear that no plan covers and nothing declares whole on purpose, before anything changes; a literal `plan=` or a
`filter_fn` names what stays whole, so it is not refused.

The models are diffusers' own classes at tiny seeded sizes; what they hold is read off the model (its blocks'
Linears), independently of the plans under test.
"""

from __future__ import annotations

import re
import unittest
from unittest import mock

import diffusers
import torch
import torch.nn as nn
from parameterized import parameterized
from torch.distributed.device_mesh import init_device_mesh
from diffusers.models.transformers.t5_film_transformer import T5DenseGatedActDense
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import conformance_worker as W
import surgery
from surgery.core import registry
from surgery.parallel import plans
from surgery.parallel.derive import derived
from surgery.parallel.distributed import fake_process_group
from surgery.parallel.plans import checked_plan
from surgery.testing import assert_unchanged, snapshot

# diffusers classes that the registered plans covered only in part (their FeedForwards): tiny configs of each.
# (Wan, SkyReels-V2, SD3, CogVideoX, CogView4, HunyuanVideo-1.5 and Mochi now shard by derivation: rewrites/wan.py,
# skyreels_v2.py, sd3.py, cogvideox.py, cogview4.py, hunyuan_video15.py, mochi.py.)
HALF_PLANNED = {
    # the t5-film family plans it whole (rewrites/t5_film.py); here its gated T5 feed-forwards run under a class no plan
    # names (`UnplannedGatedDense`), so its attentions are planned and they are not
    "T5FilmDecoder": dict(input_dims=8, targets_length=8, max_decoder_noise_time=2000.0, d_model=16, num_layers=2,
                          num_heads=2, d_kv=8, d_ff=32, dropout_rate=0.1),
}

LTX2 = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
            audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
            audio_cross_attention_dim=16, num_layers=2, caption_channels=16)


class UnplannedGatedDense(T5DenseGatedActDense):
    """T5FilmDecoder's gated feed-forward as a class of its own: plans and declarations name exact classes."""


def tiny(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = getattr(diffusers, name)(**HALF_PLANNED[name])
    for module in model.modules():
        if type(module) is T5DenseGatedActDense:
            module.__class__ = UnplannedGatedDense
    return surgery.unfuse(model)


def block_attention_linears(model: nn.Module) -> list[str]:
    """The attention projections in the model's blocks, read off the model: Linears named like diffusers'
    attention projections under a module that has `heads`."""
    names = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    return [f"{path}.{n}" for path, m in model.named_modules() if isinstance(getattr(m, "heads", None), int)
            for n in names if isinstance(getattr(m, n.split(".")[0], None), (nn.Linear, nn.ModuleList))
            and isinstance(m.get_submodule(n), nn.Linear)]


class HalfPlannedModelsAreRefused(unittest.TestCase):
    @parameterized.expand([(n,) for n in HALF_PLANNED])
    def test_refused_before_anything_changes_naming_the_first_whole_linear(self, name):
        model = tiny(name)
        attention = block_attention_linears(model)
        self.assertTrue(attention, "the model holds attention projections")
        snap = snapshot(model)
        with fake_process_group(2):
            with self.assertRaises(surgery.SurgeryError) as caught:
                surgery.tensor_parallel(model, init_device_mesh("cpu", (2,)), src_data_rank=None)
        message = str(caught.exception)
        named, owner, left, total = re.search(r"'([\w.]+)' \(Linear in a (\w+)\).* (\d+) of the (\d+) Linears",
                                              message).groups()
        # blocks read off the model as diffusers' regional compile does: its _repeated_blocks classes
        blocks = [(p, m) for p, m in model.named_modules() if type(m).__name__ in model._repeated_blocks] or [
            (f"{n}.{i}", b) for n, c in model.named_children() if isinstance(c, nn.ModuleList)
            for i, b in enumerate(c)]
        self.assertIsInstance(model.get_submodule(named), nn.Linear)
        self.assertEqual(type(model.get_submodule(named.rpartition(".")[0])).__name__, owner)
        self.assertTrue(any(named.startswith(b + ".") for b, _ in blocks))
        self.assertEqual(int(total), sum(isinstance(m, nn.Linear) for _, b in blocks for m in b.modules()))
        left = int(left)
        # every attention projection in a block is among those left whole, but those of attentions that derive a
        # plan (a head-dim twin, or the stock processor on DTensors)
        twinned = [path for path, m in model.named_modules() if isinstance(derived(m), dict)]
        in_blocks = [p for p in attention if any(p.startswith(b + ".") for b, _ in blocks)
                     and not any(p.startswith(t + ".") for t in twinned)]
        self.assertGreaterEqual(left, len(in_blocks))
        self.assertNotIn("\n", message)
        assert_unchanged(model, snap)

    def test_a_literal_plan_or_a_filter_names_what_stays_whole(self):
        model = tiny("T5FilmDecoder")
        literal = {"decoders.*.layer.2.DenseReluDense.wi_0": ColwiseParallel(),
                   "decoders.*.layer.2.DenseReluDense.wi_1": ColwiseParallel(),
                   "decoders.*.layer.2.DenseReluDense.wo": RowwiseParallel()}
        self.assertEqual(len(checked_plan(model, literal, None, 2)), 2)
        self.assertEqual(len(checked_plan(model, None, lambda m, fqn: True, 2)), 4)  # the 2 x 2 attentions
        with self.assertRaises(surgery.SurgeryError):
            checked_plan(model, None, None, 2)


class ExplicitRefusals(unittest.TestCase):
    def test_a_refused_class_is_refused_with_its_reason_before_anything_changes(self):
        # LTX-2 shards (rewrites/ltx2.py); refused by a registration, it is refused whole, before any change
        torch.manual_seed(0)
        model = surgery.unfuse(diffusers.LTX2VideoTransformer3DModel(**LTX2))
        snap = snapshot(model)
        reason = "its processor does something no plan follows"
        with mock.patch.dict(registry._refused, {diffusers.LTX2VideoTransformer3DModel: reason}):
            with fake_process_group(2):
                with self.assertRaisesRegex(surgery.SurgeryError, r"^surgery.tensor_parallel: "
                                                                  r"LTX2VideoTransformer3DModel is not sharded: its "
                                                                  r"processor does something no plan follows\.$"):
                    surgery.tensor_parallel(model, init_device_mesh("cpu", (2,)), src_data_rank=None)
        assert_unchanged(model, snap)


class RegisteredFamiliesAreCovered(unittest.TestCase):
    @parameterized.expand([(f.name,) for f in W.conformant_families()])
    def test_every_block_linear_is_planned_or_declared_whole(self, family_name):
        config_name = next(iter(W.families()[family_name].tests.configs))
        _, _, model = W.make(family_name, config_name)
        model = surgery.unfuse(model)
        self.assertEqual(plans.unplanned_linears(model, plans.planned_for(model))[0], [])

    def test_adaptive_norm_modulation_is_whole_by_derivation_and_refused_without_it(self):
        _, _, model = W.make("flux1", "tp_dev")
        model = surgery.unfuse(model)
        with mock.patch.dict(plans.DERIVED_REPLICATED, clear=True), mock.patch.object(plans, "ADAPTIVE_NORM_NAMES", ()):
            with self.assertRaisesRegex(surgery.SurgeryError, r"'transformer_blocks\.0\.norm1\.linear' \(Linear in "
                                                              r"a AdaLayerNormZero\)"):
                checked_plan(model, None, None, 2)
        checked_plan(model, None, None, 2)

    def test_a_models_own_adaptive_norm_is_whole_by_its_name_and_refused_without_the_rule(self):
        # CogView4AdaLayerNormZero lives in the model's own file, not diffusers.models.normalization
        _, _, model = W.make("cogview4", "tiny")
        model = surgery.unfuse(model)
        with mock.patch.object(plans, "ADAPTIVE_NORM_NAMES", ()):
            with self.assertRaisesRegex(surgery.SurgeryError, r"'transformer_blocks\.0\.norm1\.linear' \(Linear in "
                                                              r"a CogView4AdaLayerNormZero\)"):
                checked_plan(model, None, None, 2)
        checked_plan(model, None, None, 2)

    def test_a_declared_linear_is_whole_by_its_declaration_and_refused_without_it(self):
        _, _, model = W.make("qwen-image", next(iter(W.families()["qwen-image"].tests.configs)))
        block = type(model.transformer_blocks[0])
        with mock.patch.dict(registry._replicated, {block: {}}):
            with self.assertRaisesRegex(surgery.SurgeryError, r"'transformer_blocks\.0\.img_mod\.1'"):
                checked_plan(model, None, None, 2)
        checked_plan(model, None, None, 2)

    def test_a_declaration_needs_its_reason(self):
        with self.assertRaisesRegex(ValueError, "needs its reason"):
            registry.register_replicated("some.Block", {"proj": ""})


if __name__ == "__main__":
    unittest.main()
