"""Lumina2's grouped-query attention sharded: what the conformance suite (registration) does not say by itself.

The suite proves the sharded model equals the single-device one at worlds 2 and 4; these check the pieces it
relies on against diffusers' own source and layout: the processor rule's edits of the GQA processor, that contiguous
shards of query and key/value heads keep every query group with its key/value head (and that a misaligned key/value
shard is caught), and that a mesh which cuts the key/value heads is refused before anything is sharded.
"""

from __future__ import annotations

import copy
import inspect
import unittest

import torch
from torch.distributed.device_mesh import init_device_mesh

import surgery
from surgery.core import leaves
from surgery.core.build import model_on_meta
from surgery.parallel.distributed import fake_process_group
from surgery.testing import FP32_TOL, rel_err, seeded_model


def _lumina2():
    family = surgery.extend.families()["lumina2"]
    return family, dict(family.test_configs["tiny"])


class Lumina2GroupedQueries(unittest.TestCase):
    def test_the_rule_reads_the_head_counts_off_the_query_width(self):
        from diffusers.models.transformers.transformer_lumina2 import Lumina2AttnProcessor2_0

        source = inspect.getsource(Lumina2AttnProcessor2_0.__call__)
        # diffusers' spelling, counted here independently of the rule: the head size from the local query width
        # over the stored count, one view and one merge by the count, the group ratio by the count
        self.assertEqual(source.count("head_dim = query_dim // attn.heads"), 1)
        self.assertEqual(source.count("query_dim = query.shape[-1]"), 1)
        self.assertEqual(source.count("attn.heads"), 4)
        edited = leaves.edited_source(Lumina2AttnProcessor2_0)
        self.assertNotIn("attn.heads, head_dim", edited)
        self.assertNotIn("attn.heads * head_dim", edited)
        self.assertNotIn("attn.heads //", edited.replace("attn.inner_dim // attn.heads", ""))
        self.assertIn("n_rep = query_dim // head_dim // kv_heads", edited)

    def test_contiguous_shards_keep_each_query_group_with_its_key_value_head(self):
        # each rank's share of an unfused attention (q rows of heads / N heads, k/v rows of kv_heads / N, to_out
        # columns of its q heads) run through the twin processor; the shares' outputs sum to the whole module's.
        # Sliced here by hand from diffusers' layout (rows head-major), independently of the plan's styles
        family, config = _lumina2()
        model = surgery.unfuse(seeded_model(family, config, 0))
        attn = model.layers[0].attn
        heads, head_dim = attn.heads, attn.to_q.out_features // attn.heads
        kv_heads = attn.to_k.out_features // head_dim
        x = torch.randn(2, 6, attn.to_q.in_features, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            whole = attn(x, x)
            for world in (2, 4):
                def share(rank, kv_rank):
                    part = copy.deepcopy(attn)
                    q = slice(rank * heads // world * head_dim, (rank + 1) * heads // world * head_dim)
                    kv = slice(kv_rank * kv_heads // world * head_dim, (kv_rank + 1) * kv_heads // world * head_dim)
                    for name, rows in (("to_q", q), ("to_k", kv), ("to_v", kv)):
                        getattr(part, name).weight = torch.nn.Parameter(getattr(attn, name).weight[rows])
                    part.to_out[0].weight = torch.nn.Parameter(attn.to_out[0].weight[:, q])
                    return part(x, x)

                aligned = sum(share(r, r) for r in range(world))
                self.assertLessEqual(rel_err(aligned, whole), FP32_TOL, f"world {world}")
                # a key/value shard one rank off: the groups meet the wrong keys, far beyond the tolerance
                shifted = sum(share(r, (r + 1) % world) for r in range(world))
                self.assertGreater(rel_err(shifted, whole), 100 * FP32_TOL, f"world {world}")

    def test_a_mesh_that_cuts_the_key_value_heads_is_refused_by_name(self):
        family, config = _lumina2()  # 8 query heads, 4 key/value heads: 8 ranks split the first, not the second
        model = surgery.unfuse(model_on_meta(family, config))
        before = {n: (p.shape, type(p)) for n, p in model.named_parameters()}
        with fake_process_group(8):
            with self.assertRaisesRegex(surgery.SurgeryError,
                                        r"'noise_refiner\.0\.attn\.to_k' holds 4 key/value heads \(grouped-query: "
                                        r"8 query heads\) of 8, which a mesh of 8 cannot split evenly.*\[1, 2, 4\]"):
                surgery.tensor_parallel(model, init_device_mesh("cpu", (8,)), src_data_rank=None)
        self.assertEqual({n: (p.shape, type(p)) for n, p in model.named_parameters()}, before)


class Kandinsky5Names(unittest.TestCase):
    def test_the_rule_reads_the_reshape_by_num_heads_with_the_query_width(self):
        from diffusers.models.transformers.transformer_kandinsky import Kandinsky5AttnProcessor

        source = inspect.getsource(Kandinsky5AttnProcessor.__call__)
        # counted here from diffusers' source: q, k, v reshaped by the stored count in each of its two branches
        self.assertEqual(source.count("reshape(*shape, attn.num_heads, -1)")
                         + source.count("reshape(*cond_shape, attn.num_heads, -1)"), 6)
        edited = leaves.edited_source(Kandinsky5AttnProcessor)
        self.assertNotIn("attn.num_heads, -1)", edited)
        self.assertEqual(edited.count("-1, attn.to_query.out_features // attn.num_heads)"), 6)

    def test_the_derived_plan_reads_kandinsky5s_names_as_their_roles(self):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

        from surgery.parallel.derive import derived

        family = surgery.extend.families()["kandinsky5"]
        model = surgery.unfuse(model_on_meta(family, family.config()))
        block = model.visual_transformer_blocks[0]
        # diffusers' layout: to_query/to_key/to_value read the input, out_layer writes the output, query_norm and
        # key_norm normalize one head (64 = the rotary axes 16 + 24 + 24)
        for name in ("self_attention", "cross_attention"):
            attention = getattr(block, name)
            self.assertEqual(attention.query_norm.weight.shape[-1], 64)
            plan = derived(attention)
            self.assertEqual({k: type(v) for k, v in plan.items()},
                             {"to_query": ColwiseParallel, "to_key": ColwiseParallel, "to_value": ColwiseParallel,
                              "out_layer": RowwiseParallel, "query_norm": SequenceParallel,
                              "key_norm": SequenceParallel})

    def test_a_stock_processor_reshaping_by_num_heads_is_refused(self):
        # Kandinsky 6 SR: the same attention spelling, no registered family, so nothing twins its processor; without
        # the refusal its `unflatten(-1, (attn.num_heads, -1))` would cut each rank's heads into num_heads pieces
        from diffusers.models.transformers.transformer_kandinsky6_sr import Kandinsky6SRTransformer3DModel

        with torch.device("meta"):
            model = Kandinsky6SRTransformer3DModel(in_visual_dim=4, out_visual_dim=4, time_dim=16, model_dim=32,
                                                   ff_dim=64, num_visual_blocks=1, axes_dims=(2, 2, 4))
        with fake_process_group(2):
            with self.assertRaisesRegex(surgery.SurgeryError, r"Kandinsky6SRAttnProcessor reshapes by the stored "
                                                              r"head count"):
                surgery.tensor_parallel(surgery.unfuse(model), init_device_mesh("cpu", (2,)), src_data_rank=None)
        # Kandinsky 5's stock model (its family registered): refused as not yet unfused
        family = surgery.extend.families()["kandinsky5"]
        with fake_process_group(2):
            with self.assertRaisesRegex(surgery.SurgeryError, r"still a fused Kandinsky5Attention.*surgery\.unfuse"):
                surgery.tensor_parallel(model_on_meta(family, family.test_configs["tiny"]),
                                        init_device_mesh("cpu", (2,)), src_data_rank=None)

if __name__ == "__main__":
    unittest.main()
