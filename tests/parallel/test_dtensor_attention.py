"""The DTensor path for attention processors that no head-dim twin covers (`surgery.parallel.dtensor_attention`):
chosen only where the twin cannot run, the stock processor left as it is, and no collective hidden in its views,
grouped-query repeats or attention (counted on torch's fake process group: the calls, not their values; the values
at world 2 and 4 are the conformance suite's)."""

from __future__ import annotations

import unittest

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import conformance_worker as W
import surgery
from surgery.parallel.distributed import fake_process_group
from surgery.parallel.dtensor_attention import ImplicitReplication
from surgery.parallel.plans import effective_plan
from surgery.testing import CollectiveCounter


def sharded(family_name: str, world: int = 2):
    family, config, model = W.make(family_name, "tiny")
    return family, config, surgery.unfuse(model)


class Choice(unittest.TestCase):
    def test_a_processor_no_twin_covers_runs_unmodified_on_dtensors(self):
        from diffusers.models.transformers.transformer_krea2 import Krea2AttnProcessor

        _, _, model = sharded("krea2")
        attn = model.transformer_blocks[0].attn
        self.assertIs(type(attn.processor), Krea2AttnProcessor)  # the stock class: no twin, no copy
        plan = effective_plan(model, "transformer_blocks.0.attn")
        self.assertIsInstance(plan[""], ImplicitReplication)
        for name in ("to_q", "to_k", "to_v", "to_gate"):
            self.assertIs(type(plan[name]), ColwiseParallel, name)
            self.assertFalse(plan[name].use_local_output, name)
        self.assertIs(type(plan["to_out.0"]), RowwiseParallel)

    def test_the_head_dim_twin_stays_the_path_where_it_applies(self):
        _, _, model = sharded("minimax-h3")
        attn = model.transformer_blocks[0].attn
        self.assertTrue(type(attn.processor).__name__.startswith("HeadDim"))
        plan = effective_plan(model, "transformer_blocks.0.attn")
        self.assertNotIn("", plan)
        self.assertTrue(plan["to_q"].use_local_output)


class Collectives(unittest.TestCase):
    def forward_and_backward(self, family_name: str, world: int) -> tuple[dict, dict]:
        family, config, model = sharded(family_name)
        kw = W.inputs(family, config, seed=0)
        with fake_process_group(world):
            surgery.tensor_parallel(model, init_device_mesh("cpu", (world,)), src_data_rank=None)
            with CollectiveCounter() as forward:
                out = W.output(model, kw)
            self.assertFalse(isinstance(out, DTensor), "a DTensor left the attention")
            with CollectiveCounter() as backward:
                out.sum().backward()
        return dict(forward.counts), dict(backward.counts)

    def test_grouped_query_attention_on_dtensors_makes_only_the_rowwise_all_reduces(self):
        # Krea2: unflatten by num_heads / num_kv_heads, repeat_interleave of the key/value heads, a mask, rotary
        # tables, CPU flash attention, a gate as wide as q: one all-reduce per rowwise output (to_out, ff.down), none
        # hidden in a view, a repeat or the attention
        family = W.families()["krea2"]
        for world in (2, 4):
            forward, _ = self.forward_and_backward("krea2", world)
            self.assertEqual(forward, {"all_reduce": family.tp.all_reduces(family.tests.configs["tiny"])}, world)

    def test_backward_reduces_only_what_replicated_inputs_and_weights_need(self):
        # the backward: a gradient for each replicated input of an attention and each replicated weight (q/k norms)
        # is summed over ranks; nothing is gathered
        _, backward = self.forward_and_backward("krea2", 2)
        self.assertEqual(set(backward), {"all_reduce"})


if __name__ == "__main__":
    unittest.main()


class PerHeadMask(unittest.TestCase):
    def test_a_mask_with_one_entry_per_head_reaches_each_rank_as_its_heads_share(self):
        # the CPU attention op takes its mask as a keyword argument, which DTensor does not reshard: Lumina-Next's
        # mask, expanded over `attn.heads`, would reach a rank's share of the heads whole. Here each head's mask
        # differs, so a wrong share shows in the values (rank 0 of a fake group holds the first half of the heads)
        from torch.distributed.tensor import Replicate, Shard

        from surgery.parallel.dtensor_attention import register_cpu_attention_sharding

        register_cpu_attention_sharding()
        generator = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 8, 6, 4, generator=generator, requires_grad=True) for _ in range(3))
        mask = torch.randn(2, 8, 6, 6, generator=generator) > 0
        mask[..., 0] = True  # every query sees a key
        with fake_process_group(2):
            mesh = init_device_mesh("cpu", (2,))
            local = [DTensor.from_local(t[:, :4], mesh, (Shard(1),), run_check=False) for t in (q, k, v)]
            with CollectiveCounter() as counted:
                out = torch.nn.functional.scaled_dot_product_attention(
                    *local, attn_mask=DTensor.from_local(mask, mesh, (Replicate(),), run_check=False))
                out.to_local().sum().backward()
        self.assertEqual(dict(counted.counts), {})
        self.assertEqual(out.placements, (Shard(1),))
        expected = torch.nn.functional.scaled_dot_product_attention(*(t[:, :4] for t in (q, k, v)),
                                                                    attn_mask=mask[:, :4])
        torch.testing.assert_close(out.to_local(), expected)
