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
    return family, dict(family.tests.configs["tiny"])


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


if __name__ == "__main__":
    unittest.main()
