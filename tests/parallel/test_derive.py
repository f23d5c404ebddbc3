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
import surgery.core.rewrite
from surgery.core.build import build
from surgery.core.registry import model_class, tp_plan_for
from surgery.testing import CollectiveCounter, assert_unchanged, rel_err, snapshot
from surgery.parallel.distributed import fake_process_group
from surgery.parallel.families import all_reduces
from surgery.parallel.plans import planned_for, transformer_blocks
from surgery.parallel.derive import (
    AcrossHeadsNorm,
    Refused,
    RotaryAcrossWidth,
    attention_plan,
    derived,
    feed_forward_parts,
    is_attention,
    projection_plan,
    single_stream_parts,
    whole_key_values,
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
        model = cls(**next(iter(family.tests.configs.values())))  # the stock model, not unfused
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
    def test_a_processor_that_reads_the_head_count_runs_on_dtensors_until_its_twin_runs(self):
        from surgery.parallel.dtensor_attention import ImplicitReplication

        torch.manual_seed(0)
        model = diffusers.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1,
                                                attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                                caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
                                                pos_embed_max_size=8)
        plan = attention_plan(model.transformer_blocks[0].attn)  # the stock JointAttnProcessor2_0: no twin yet
        self.assertIsInstance(plan[""], ImplicitReplication)
        self.assertFalse(plan["to_q"].use_local_output)
        surgery.unfuse(model)  # its twin, the faster path, takes over
        plan = attention_plan(model.transformer_blocks[0].attn)
        self.assertNotIn("", plan)
        self.assertTrue(plan["to_q"].use_local_output)

    def test_a_processor_calling_the_modules_head_reshapes_reads_the_head_count(self):
        # AttnProcessor (`Attention(scale_qk=False)`'s) splits heads through `attn.head_to_batch_dim`, which reshapes
        # by `self.heads`: read as plain colwise, a rank holding half the heads would split its width into all of them
        from surgery.parallel.dtensor_attention import ImplicitReplication

        torch.manual_seed(0)
        model = diffusers.T5FilmDecoder(input_dims=8, targets_length=8, d_model=16, num_layers=1, num_heads=2, d_kv=8,
                                        d_ff=32)
        attention = model.decoders[0].layer[0].attention
        self.assertIs(type(attention.processor), diffusers.models.attention_processor.AttnProcessor)
        self.assertIsInstance(attention_plan(attention)[""], ImplicitReplication)
        surgery.unfuse(model)  # rewrites/t5_film.py's twin: heads split by the head size, no DTensors
        self.assertNotIn("", attention_plan(model.decoders[0].layer[0].attention))

    def test_a_torch_rms_norm_across_heads_is_refused_until_unfused(self):
        torch.manual_seed(0)
        model = diffusers.WanTransformer3DModel(**W.families()["wan"].tests.configs["tiny"])
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
        model = surgery.unfuse(diffusers.WanTransformer3DModel(**W.families()["wan"].tests.configs["tiny"]))
        attn = model.blocks[0].attn1
        self.assertIsInstance(derived(attn), dict)
        attn.to_gate = nn.Linear(32, 3)  # not one output per head (4)
        plan = derived(attn)
        self.assertIsInstance(plan, Refused)
        self.assertIn("`to_gate` (32 -> 3) has no derivation rule", plan.reason)

    def test_a_per_head_gate_is_colwise_with_the_heads_and_one_of_another_input_is_refused(self):
        torch.manual_seed(0)
        model = surgery.unfuse(diffusers.WanTransformer3DModel(**W.families()["wan"].tests.configs["tiny"]))
        attn = model.blocks[0].attn1
        attn.to_gate_logits = nn.Linear(32, 4)  # the query's input -> one logit per head (LTX-2's gated attention)
        self.assertIs(type(derived(attn)["to_gate_logits"]), ColwiseParallel)
        attn.to_gate_logits = nn.Linear(16, 4)  # another input: what it reads is not known
        self.assertIn("`to_gate_logits` (16 -> 4) has no derivation rule", derived(attn).reason)


class Rotary(unittest.TestCase):
    """`RotaryAcrossWidth` against diffusers' own rotations of the whole width: a rank's local q rotated by its share
    of the tables equals its columns of q rotated whole, for both layouts LTX-2 writes and LTX-Video's."""

    def rotated_share(self, rotate, tables, world, rank, positional=False):
        from torch.distributed.device_mesh import init_device_mesh

        from surgery.parallel.distributed import fake_process_group

        class Rotating(nn.Module):
            def forward(self, query, query_rotary_emb=None, key_rotary_emb=None):
                return rotate(query, query_rotary_emb)

        query = torch.randn(2, tables[0].shape[-2] if tables[0].ndim == 4 else tables[0].shape[1], 32,
                            generator=torch.Generator().manual_seed(rank))
        width = 32 // world
        with fake_process_group(world, rank):
            module = RotaryAcrossWidth("query_rotary_emb", "key_rotary_emb")._apply(
                Rotating(), init_device_mesh("cpu", (world,)))
            local = query[..., rank * width:(rank + 1) * width]
            got = module(local, tables) if positional else module(local, query_rotary_emb=tables)
        return got, rotate(query, tables)[..., rank * width:(rank + 1) * width]

    def test_split_tables_by_heads_interleaved_by_width(self):
        from diffusers.models.transformers import transformer_ltx as ltx, transformer_ltx2 as ltx2

        coords = torch.rand(2, 3, 6, 2) * 100
        cases = [
            (ltx2.apply_split_rotary_emb,
             ltx2.LTX2AudioVideoRotaryPosEmbed(dim=32, rope_type="split", num_attention_heads=4)(coords)),
            (ltx2.apply_interleaved_rotary_emb, ltx2.LTX2AudioVideoRotaryPosEmbed(dim=32)(coords)),
            # 32 % 6: two padding entries (cos 1, sin 0) lead LTX-Video's tables
            (ltx.apply_rotary_emb, ltx.LTXVideoRotaryPosEmbed(dim=32)(torch.zeros(2, 6, 32), 1, 2, 3, (0.3, 32, 32))),
        ]
        for rotate, tables in cases:
            for world, rank, positional in ((2, 1, False), (4, 2, True)):
                got, expected = self.rotated_share(rotate, tables, world, rank, positional)
                self.assertTrue(torch.equal(got, expected), (rotate.__name__, world, rank))

    def test_tables_the_mesh_cannot_split_like_the_heads_are_refused(self):
        from diffusers.models.transformers import transformer_ltx2 as ltx2

        tables = ltx2.LTX2AudioVideoRotaryPosEmbed(dim=24, rope_type="split", num_attention_heads=3)(
            torch.rand(1, 3, 4, 2))
        with self.assertRaisesRegex(surgery.SurgeryError, r"rotary table of shape \(1, 3, 4, 4\) has 3 entries on "
                                                          r"dim 1, which a mesh of 2 cannot split"):
            self.rotated_share(ltx2.apply_split_rotary_emb, tables, 2, 0)

    def test_ltx_attention_plans_name_their_rotary_arguments_and_gates(self):
        for family_name, config_name, names in (("ltx-video", "tiny", ("image_rotary_emb",)),
                                                ("ltx-2", "tiny", ("query_rotary_emb", "key_rotary_emb"))):
            _, _, model = W.make(family_name, config_name)
            model = surgery.unfuse(model)
            attention = [m for m in model.modules() if is_attention(m)]
            self.assertTrue(attention)
            for attn in attention:
                plan = derived(attn)
                self.assertEqual(plan[""].names, names)
                gates = getattr(attn, "to_gate_logits", None)
                self.assertEqual("to_gate_logits" in plan, gates is not None)

    def test_a_per_head_parameter_of_an_attention_is_refused_by_name(self):
        # Helios with is_amplify_history: its processor scales the history keys by one parameter per head, whole on
        # every rank; the published Helios transformers leave it off
        torch.manual_seed(0)
        config = {**W.families()["helios"].tests.configs["tiny"], "is_amplify_history": True}
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


class SharedParts(unittest.TestCase):
    def test_norms_across_heads_on_the_shared_attention_take_their_statistic(self):
        # Sana-Sprint's `rms_norm_across_heads` on diffusers' shared `Attention`: the registered `Attention` plan
        # (norms per head) declines it, so each norm gets `AcrossHeadsNorm` (weight Shard(0), one all-reduce of a
        # number per token), not a replicated weight over a width it cannot see whole
        torch.manual_seed(0)
        config = W.families()["sana"].tests.configs["tiny_sprint"]
        model = surgery.unfuse(diffusers.SanaTransformer2DModel(**config))
        plans = {path: plan for path, _, plan in planned_for(model)}
        for attention in ("attn1", "attn2"):
            plan = plans[f"transformer_blocks.0.{attention}"]
            self.assertEqual({k for k, v in plan.items() if isinstance(v, AcrossHeadsNorm)}, {"norm_q", "norm_k"})
        self.assertEqual(sum(all_reduces(s) for p in plans.values() for s in p.values()),
                         config["num_layers"] * 2 * (1 + 2))  # per block, per attention: to_out.0 and two norms

    def test_layer_norms_across_heads_take_their_mean_and_variance(self):
        # Lumina-Next's `layer_norm_across_heads`: refused as torch's LayerNorm (F.layer_norm cannot run on a share of
        # the width), computed elementwise once unfused: weight and bias Shard(0), two all-reduces of a number per
        # token (mean, variance), never an all-gather of q/k
        from torch.distributed.tensor import DTensor, Shard

        from surgery.core.norms import ElementwiseLayerNorm

        torch.manual_seed(0)
        config = W.families()["lumina-next"].tests.configs["tiny"]
        model = diffusers.LuminaNextDiT2DModel(**config)
        plan = projection_plan(model.layers[0].attn1)
        self.assertIsInstance(plan, Refused)
        self.assertIn("norm_q is a torch.nn.LayerNorm across heads (32 = heads x 4)", plan.reason)
        unfused = surgery.unfuse(model)
        norm = unfused.layers[0].attn1.norm_q
        self.assertIs(type(norm), ElementwiseLayerNorm)
        plan = attention_plan(unfused.layers[0].attn1)
        self.assertEqual({k: all_reduces(v) for k, v in plan.items() if isinstance(v, AcrossHeadsNorm)},
                         {"norm_q": 2, "norm_k": 2})
        with torch.no_grad():  # torch's LayerNorm, to float rounding (it accumulates by Welford's method)
            norm.weight.normal_(), norm.bias.normal_()
            for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
                x = (torch.randn(2, 5, 32) * 3 + 1).to(dtype)
                stock = nn.LayerNorm(32, eps=norm.eps).to(dtype)
                stock.load_state_dict(norm.state_dict())
                self.assertLessEqual(rel_err(norm.to(dtype)(x), stock(x)), tolerance, dtype)
        norm.float()
        with fake_process_group(2):
            mesh = init_device_mesh("cpu", (2,))
            AcrossHeadsNorm(use_local_output=False, statistics=2)._apply(norm, mesh)
            self.assertEqual([p.placements for p in norm.parameters()], [(Shard(0),), (Shard(0),)])
            with CollectiveCounter() as counted:
                out = norm(DTensor.from_local(torch.randn(2, 5, 16), mesh, (Shard(-1),), run_check=False))
        self.assertEqual(dict(counted.counts), {"all_reduce": 2})
        self.assertEqual(out.placements, (Shard(2),))

    def test_a_blocks_per_head_gate_beside_dtensor_attentions_splits_like_the_heads(self):
        # Lumina-Next's block multiplies its cross-attention's output (a heads-sharded DTensor) by `gate`, one entry
        # per head: split like the heads, while the block's attentions and feed-forward keep their derived plans
        from surgery.parallel.derive import PerHeadParameters

        torch.manual_seed(0)
        model = surgery.unfuse(diffusers.LuminaNextDiT2DModel(**W.families()["lumina-next"].tests.configs["tiny"]))
        plans = {path: plan for path, _, plan in planned_for(model)}
        self.assertEqual(list(plans["layers.0"]), [""])
        self.assertEqual(plans["layers.0"][""].names, ("gate",))
        self.assertIsInstance(plans["layers.0"][""], PerHeadParameters)
        for child in ("attn1", "attn2", "feed_forward"):
            self.assertIn(f"layers.0.{child}", plans)

    def test_the_processor_rule_reads_a_streams_local_width(self):
        # HiDream's processor takes the head size from its image stream's key (`inner_dim = key_i.shape[-1]`)
        from diffusers.models.transformers.transformer_hidream_image import HiDreamAttnProcessor

        from surgery.core.leaves import edited_source, rule_edits

        self.assertIsNotNone(rule_edits(HiDreamAttnProcessor))
        source = edited_source(HiDreamAttnProcessor)
        self.assertNotIn("attn.heads, head_dim", source)
        self.assertEqual(source.count("view(batch_size, -1, inner_dim // head_dim, head_dim)"), 6)

    def test_a_plain_sequential_mlp_derives_like_a_feed_forward_and_no_other_sequential_does(self):
        # WanAnimate2's `ffn = Sequential(Linear, GELU, Linear)`: colwise in, rowwise out, one all-reduce
        torch.manual_seed(0)
        config = W.families()["wan-animate-2"].tests.configs["tiny"]
        model = surgery.unfuse(diffusers.WanAnimate2Transformer3DModel(**config))
        plans = {path: plan for path, _, plan in planned_for(model)}
        plan = plans["blocks.0.ffn"]
        self.assertEqual({k: type(v) for k, v in plan.items()}, {"0": ColwiseParallel, "2": RowwiseParallel})
        self.assertEqual(sum(all_reduces(s) for s in plan.values()), 1)
        # a modulation `Sequential(SiLU, Linear)`, an MLP whose last Linear does not read the first's width, one
        # with a non-elementwise module in between: no rule
        for other in (nn.Sequential(nn.SiLU(), nn.Linear(4, 8)),
                      nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(4, 4)),
                      nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4))):
            self.assertIsNone(derived(other), other)


if __name__ == "__main__":
    unittest.main()


class MultiQuery(unittest.TestCase):
    def test_one_key_value_head_stays_whole_only_where_the_processor_runs_on_dtensors(self):
        # DreamLite's attentions: 8 query heads over one key/value head. Under the processor its pipeline sets (it
        # reads the head count: DTensor q/k/v), the one head is replicated and the queries split; under the model's own
        # default processor (unfused: the head-dim twin, which reads local widths) nothing is kept whole, and the
        # heads check refuses the mesh (a replicated key beside a twin's per-head norm would count its gradient twice)
        # (also as many heads as each head's size, DreamLite's UNet tests' 8 of 8: a key as wide as a per-head gate)
        family = W.families()["dreamlite"]
        tiny = family.tests.configs["tiny"]
        for config in (tiny, {**tiny, "attention_head_dim": tiny["num_attention_heads"]}):
            with torch.device("meta"):
                published = surgery.unfuse(build(family, config))
                default = surgery.unfuse(model_class(family)(**config))
            for name in ("attn1", "attn2"):
                attention = published.transformer_blocks[0].get_submodule(name)
                self.assertEqual(whole_key_values(attention), ("to_k", "to_v"))
                plan = attention_plan(attention)
                self.assertEqual(sorted(k for k in plan if k), ["to_out.0", "to_q"])
                self.assertEqual(whole_key_values(default.transformer_blocks[0].get_submodule(name)), ())
            with fake_process_group(2), self.assertRaisesRegex(surgery.SurgeryError, "attn1.to_k' holds 1 key/value"):
                surgery.tensor_parallel(default, init_device_mesh("cpu", (2,)))


class AllReduces(unittest.TestCase):
    @parameterized.expand([(f.name,) for f in W.conformant_families()])
    def test_all_reduces_read_off_the_plan_equal_the_familys_count(self, family_name):
        # the hand-written families' counts (lambdas over the config) are independent of `all_reduces`
        family = W.families()[family_name]
        for config in family.tests.configs.values():
            with torch.device("meta"):  # the class as is: a test config may lie outside the published range
                model = surgery.core.rewrite.unfuse(build(family, config))
            styled = [(model.get_submodule(".".join(p for p in (path, key) if p)), style)
                      for path, _, plan in planned_for(model) for key, style in plan.items()]
            # planned modules the forward never calls make none (SANA-WM's refiner keeps LTX-2's audio stream unused)
            called = set()
            hooks = [m.register_forward_pre_hook(lambda mod, args: called.add(id(mod))) for m, _ in styled]
            try:
                with torch.no_grad():
                    model(**family.example_inputs(config, device="meta"))
            except Exception:  # noqa: BLE001 - a forward that needs real values: every planned module taken as called
                called = {id(m) for m, _ in styled}
            for hook in hooks:
                hook.remove()
            read = sum(all_reduces(style) for m, style in styled if id(m) in called)
            # at least one per planned style; more where a forward runs a module twice (CogView4's blocks run one
            # feed-forward on both streams): the exact number is what the conformance world-2 job measures
            self.assertGreaterEqual(family.tp.all_reduces(config), read)
            self.assertLessEqual(family.tp.all_reduces(config), 2 * read)


class DepthwiseChannelsStyle(unittest.TestCase):
    """`DepthwiseChannels`: a depthwise convolution over a heads-sharded width computes each rank's channels with its
    own filters, forward and backward, with no collective (on torch's fake process group, rank 1 of 2: the values
    need no other rank)."""

    def test_rank_convolves_its_own_channels(self):
        from diffusers.models.transformers.transformer_sana_wm import SanaWMTemporalShortConvolution
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        from surgery.parallel.derive import DepthwiseChannels
        from surgery.parallel.distributed import fake_process_group
        from surgery.testing import CollectiveCounter, rel_err

        torch.manual_seed(0)
        whole = SanaWMTemporalShortConvolution(hidden_size=8, kernel_size=3)
        torch.nn.init.normal_(whole.weight)
        x = torch.randn(2, 3 * 4, 8, requires_grad=True)  # 3 frames of 4 tokens, 8 channels
        expected = whole(x, 3)
        (expected * torch.arange(8.0)).sum().backward()
        with fake_process_group(2, rank=1):
            conv = parallelize_module(SanaWMTemporalShortConvolution(8, 3), init_device_mesh("cpu", (2,)),
                                      DepthwiseChannels())
            with torch.no_grad():
                conv.weight.to_local().copy_(whole.weight[4:])
            share = x.detach()[..., 4:].clone().requires_grad_(True)
            with CollectiveCounter() as counter:
                got = conv(share, 3)
                (got * torch.arange(4.0, 8.0)).sum().backward()
            self.assertEqual(counter.total, 0)
            self.assertLessEqual(rel_err(got, expected[..., 4:]), 1e-6)
            self.assertLessEqual(rel_err(share.grad, x.grad[..., 4:]), 1e-6)
            self.assertLessEqual(rel_err(conv.weight.grad.to_local(), whole.weight.grad[4:]), 1e-6)
