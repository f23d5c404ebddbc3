"""The derivation engine (`surgery.parallel.derive`) against what exists: diffusers' own `_tp_plan` for FLUX.1,
FLUX.2 and QwenImage (the attention projections and FeedForwards it plans are planned alike by derivation, read off
the stock model), and its refusals, one line naming what it found."""

from __future__ import annotations

import unittest
from fnmatch import fnmatchcase

import diffusers
import torch
import torch.nn as nn
from parameterized import parameterized
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import conformance_worker as W
import surgery
from surgery.app import coverage
from surgery.core.registry import model_class, tp_plan_for
from surgery.testing import assert_unchanged, snapshot
from surgery.parallel.distributed import fake_process_group
from surgery.parallel.families import all_reduces
from surgery.parallel.plans import planned_for, transformer_blocks
from surgery.parallel.derive import (
    AcrossHeadsNorm,
    Refused,
    attention_plan,
    derived,
    feed_forward_parts,
    is_attention,
    projection_plan,
    single_stream_parts,
)

STOCK = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def derived_linear_styles(model: nn.Module) -> dict[str, type]:
    """Path -> style class for every Linear the derivation plans in the stock model's blocks: attention projections
    by `projection_plan`, FeedForwards by their registered shared plan."""
    out = {}
    for block, module in transformer_blocks(model):
        for key, child in module.named_modules():
            path = f"{block}.{key}" if key else block
            # the parts diffusers packs (a gated FF's fused rows, cat([attn, mlp])) are Packed* styles there, left out
            parts, ff = single_stream_parts(child), feed_forward_parts(child)
            plan = projection_plan(child) if is_attention(child) else (
                tp_plan_for(child)[0] if type(child).__name__ == "FeedForward" else
                {parts[1]: ColwiseParallel()} if parts else
                {ff[1]: RowwiseParallel(), **({} if ff[2] else dict.fromkeys(ff[0], ColwiseParallel()))} if ff else None)
            if isinstance(plan, dict):
                for name, style in plan.items():
                    if isinstance(child.get_submodule(name), nn.Linear):
                        out[f"{path}.{name}"] = type(style)
    return out


class AgainstDiffusersTpPlan(unittest.TestCase):
    @parameterized.expand([("flux1",), ("flux2",), ("qwen-image",), ("qwen-image-2.1",)])
    def test_derived_styles_equal_diffusers_tp_plan(self, family_name):
        family = W.families()[family_name]
        cls = model_class(family)
        torch.manual_seed(0)
        model = cls(**next(iter(family.test_configs.values())))  # the stock model, not unfused
        theirs = {key: STOCK[style] for key, style in cls._tp_plan.items() if isinstance(style, str)}
        ours = derived_linear_styles(model)
        # every string entry of diffusers' plan names Linears the derivation plans the same way
        matched = set()
        for key, style in theirs.items():
            hits = [path for path in ours if fnmatchcase(path, key)]
            self.assertTrue(hits, f"{key}: derived nothing")
            for path in hits:
                self.assertIs(ours[path], style, path)
            matched.update(hits)
        # and the derivation plans nothing else among the Linears diffusers' plan places in these modules
        self.assertEqual(sorted(set(ours) - matched), [])


class Refusals(unittest.TestCase):
    def test_a_processor_that_reads_the_head_count_is_refused_by_name(self):
        torch.manual_seed(0)
        model = diffusers.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1,
                                                attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                                caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
                                                pos_embed_max_size=8)
        plan = attention_plan(model.transformer_blocks[0].attn)
        self.assertIsInstance(plan, Refused)
        self.assertIn("JointAttnProcessor2_0", plan.reason)
        self.assertNotIn("\n", plan.reason)

    def test_a_torch_rms_norm_across_heads_is_refused_until_unfused(self):
        torch.manual_seed(0)
        model = diffusers.WanTransformer3DModel(**W.families()["wan"].test_configs["tiny"])
        attn = model.blocks[0].attn1
        plan = projection_plan(attn)
        self.assertIsInstance(plan, Refused)
        self.assertIn("norm_q is a torch.nn.RMSNorm across heads (32 = heads x 8)", plan.reason)
        unfused = surgery.unfuse(model)
        plan = attention_plan(unfused.blocks[0].attn1)
        self.assertIsInstance(plan["norm_q"], AcrossHeadsNorm)
        self.assertEqual({k for k, v in plan.items() if isinstance(v, RowwiseParallel)}, {"to_out.0"})

    def test_a_linear_without_a_rule_is_refused_by_name(self):
        torch.manual_seed(0)
        model = surgery.unfuse(diffusers.WanTransformer3DModel(**W.families()["wan"].test_configs["tiny"]))
        attn = model.blocks[0].attn1
        self.assertIsInstance(derived(attn), dict)
        attn.to_gate = nn.Linear(32, 4)
        plan = derived(attn)
        self.assertIsInstance(plan, Refused)
        self.assertIn("`to_gate` (32 -> 4) has no derivation rule", plan.reason)

    def test_a_per_head_parameter_of_an_attention_is_refused_by_name(self):
        # Helios with is_amplify_history: its processor scales the history keys by one parameter per head, whole on
        # every rank; the published Helios transformers leave it off
        torch.manual_seed(0)
        config = {**W.families()["helios"].test_configs["tiny"], "is_amplify_history": True}
        model = surgery.unfuse(diffusers.HeliosTransformer3DModel(**config))
        plan = derived(model.blocks[0].attn1)
        self.assertIsInstance(plan, Refused)
        self.assertIn("own parameter `history_key_scale` (4,) has no derivation rule", plan.reason)
        self.assertIsInstance(derived(model.blocks[0].attn2), dict)  # the cross attention holds none
        snap = snapshot(model)
        with fake_process_group(2), self.assertRaises(surgery.SurgeryError) as caught:
            surgery.tensor_parallel(model, init_device_mesh("cpu", (2,)), src_data_rank=None)
        self.assertIn("no plan derived for 'blocks.0.attn1': its own parameter `history_key_scale`",
                      str(caught.exception))
        assert_unchanged(model, snap)


if __name__ == "__main__":
    unittest.main()


class AllReducesAndTheFamiliesPage(unittest.TestCase):
    @parameterized.expand([(f.name,) for f in W.conformant_families()])
    def test_all_reduces_read_off_the_plan_equal_the_familys_count(self, family_name):
        # the hand-written families' counts (lambdas over the config) are independent of `all_reduces`
        family = W.families()[family_name]
        for config in family.test_configs.values():
            with torch.device("meta"):  # the class as is: a test config may lie outside the published range
                model = surgery.extend.unfuse(model_class(family)(**config))
            read = sum(all_reduces(style) for _, _, plan in planned_for(model) for style in plan.values())
            # at least one per planned style; more where a forward runs a module twice (CogView4's blocks run one
            # feed-forward on both streams): the exact number is what the conformance world-2 job measures
            self.assertGreaterEqual(family.count_all_reduces(config), read)
            self.assertLessEqual(family.count_all_reduces(config), 2 * read)

    def test_the_families_page_rows_of_registered_families_are_current(self):
        page = coverage.DOC.read_text()
        for family in W.conformant_families():
            row = coverage.table([coverage.class_status(model_class(family))]).splitlines()[-1]
            self.assertIn(row, page, "run `python -m surgery.app.coverage`")
            self.assertIn("| sharded |", row)

    def test_surgery_families_prints_a_row_per_class(self):
        import contextlib
        import io
        from unittest import mock

        from surgery.app import cli

        classes = [diffusers.WanTransformer3DModel, diffusers.AuraFlowTransformer2DModel]
        out = io.StringIO()
        with mock.patch.object(coverage, "transformer_classes", return_value=classes), contextlib.redirect_stdout(out):
            self.assertEqual(cli.main(["families"]), 0)
        rows = out.getvalue().splitlines()
        wan = W.families()["wan"]
        self.assertEqual(rows[2], f"| WanTransformer3DModel | wan | sharded | {wan.count_all_reduces(wan.config())} |")
        self.assertTrue(rows[3].startswith("| AuraFlowTransformer2DModel |  | refused | 'joint_transformer_blocks.0.attn"
                                           ".to_q' (Linear in a Attention) has no tensor-parallel plan"), rows[3])
        self.assertIn("AuraFlowAttnProcessor2_0", rows[3])
