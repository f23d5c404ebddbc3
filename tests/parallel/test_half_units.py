"""A `plan=` or `filter_fn=` that keeps part of a planned module (q/k/v without their output projection, Linears
without the heads' norms: torchao's `lambda m, fqn: isinstance(m, nn.Linear)` filter) is refused when the plan is
made, before the model changes, naming the module and the partner left whole (issue 41: it sharded, then the forward
failed or the gradients were wrong)."""

import copy
import unittest

import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import surgery
from flux2_testing import build, small_config
from surgery.core.build import model_on_meta
from surgery.core.registry import families
from surgery.parallel.plans import checked_plan, effective_plan
from surgery.testing import assert_unchanged, single_rank_group, snapshot

CONFIG = small_config("klein4b_small")


class HalfAModule(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.fused = build(CONFIG, 0)

    def refused(self, pattern: str, plan=None, filter_fn=None):
        model = surgery.unfuse(copy.deepcopy(self.fused))
        before = snapshot(model)
        with single_rank_group(), self.assertRaisesRegex(surgery.SurgeryError, pattern):
            surgery.tensor_parallel(model, init_device_mesh("cpu", (1,)), plan, filter_fn)
        assert_unchanged(model, before)

    def test_torchaos_linear_filter(self):
        self.refused(r"filter_fn shards 'to_q' \(ColwiseParallel\), 'to_k' \(ColwiseParallel\), 'to_v' "
                     r"\(ColwiseParallel\) and 5 more of 'transformer_blocks.0.attn' \(Flux2Attention\) but leaves its "
                     r"partners 'norm_q' \(SequenceParallel\), 'norm_k' \(SequenceParallel\), 'norm_added_q' "
                     r"\(SequenceParallel\) and 1 more whole.*Keep or drop all 12 entries of "
                     r"'transformer_blocks.0.attn' together", filter_fn=lambda m, fqn: isinstance(m, nn.Linear))

    def test_a_filter_keeping_q_k_v_without_the_output_projection(self):
        self.refused(r"'to_q' \(ColwiseParallel\).*of 'transformer_blocks.0.attn' .*partners 'norm_q' "
                     r"\(SequenceParallel\), 'norm_k' \(SequenceParallel\), 'to_out.0' \(RowwiseParallel\) and 6 more",
                     filter_fn=lambda m, fqn: fqn.endswith(("to_q", "to_k", "to_v")))

    def test_a_split_projection_without_the_resolution_of_its_partial_sum(self):
        self.refused(r"of 'single_transformer_blocks.0.attn' \(Flux2ParallelSelfAttention\) but leaves its partner "
                     r"'to_out' \(PrepareModuleOutput\) whole",
                     filter_fn=lambda m, fqn: fqn.startswith("single") and fqn != "single_transformer_blocks.0.attn.to_out")

    def test_a_literal_plan_without_the_feed_forwards_output(self):
        model = surgery.unfuse(copy.deepcopy(self.fused))
        plan = {k: v for k, v in effective_plan(model).items() if k != "transformer_blocks.0.ff.linear_out"}
        self.refused(r"plan= shards 'linear_in.gate' \(ColwiseParallel\), 'linear_in.up' \(ColwiseParallel\) of "
                     r"'transformer_blocks.0.ff' \(Flux2FeedForward\) but leaves its partner 'linear_out' "
                     r"\(RowwiseParallel\) whole", plan=plan)

    def test_a_literal_plan_of_q_k_v_and_output(self):
        self.refused(r"plan= shards 'to_q' .* of 'transformer_blocks.0.attn' .*leaves its partners 'norm_q'",
                     plan={"transformer_blocks.*.attn.to_q": ColwiseParallel(),
                           "transformer_blocks.*.attn.to_k": ColwiseParallel(),
                           "transformer_blocks.*.attn.to_v": ColwiseParallel(),
                           "transformer_blocks.*.attn.to_out.0": RowwiseParallel()})

    def test_whole_modules_kept_or_dropped_shard(self):
        model = surgery.unfuse(copy.deepcopy(self.fused))
        with single_rank_group():
            surgery.tensor_parallel(model, init_device_mesh("cpu", (1,)),
                                    filter_fn=lambda m, fqn: not fqn.startswith("single_transformer_blocks"))
        sharded = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
        self.assertIn("transformer_blocks.0.attn.norm_q.weight", sharded)
        self.assertFalse(any(n.startswith("single") for n in sharded))

    def test_a_derived_plan_norm_across_heads(self):
        family = families()["wan"]
        model = surgery.unfuse(model_on_meta(family, family.config(next(iter(family.variants)))))
        with self.assertRaisesRegex(surgery.SurgeryError, r"of 'blocks.0.attn1' \(WanAttention\) but leaves its "
                                                          r"partners 'norm_q' \(AcrossHeadsNorm\), 'norm_k' "
                                                          r"\(AcrossHeadsNorm\) whole"):
            checked_plan(model, None, lambda m, fqn: isinstance(m, nn.Linear), 2)


if __name__ == "__main__":
    unittest.main()
