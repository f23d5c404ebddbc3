"""Per forward, the unfused model does the fused model's work and, per rank, diffusers' packed TP's (but one GEMM per
SplitProjection): GEMMs and cats
counted with a TorchDispatchMode (`surgery.testing.CollectiveCounter`), whole and on 2 gloo ranks. Where a part does
more than a plain matmul (LoRA, a hook, moved weights, gradients) the parts' own forwards run, and the values say so."""

import copy
import unittest

import torch
from parameterized import parameterized
from peft import LoraConfig, inject_adapter_in_model

import surgery
from surgery.core.split_projection import SplitProjection, SplitRows
from surgery.state_dict import unfuse_state_dict, weight_slices
from surgery.testing import CollectiveCounter, rel_err, run_on_cpu_ranks

import work_per_rank_worker as W
from conformance_worker import FP32_TOL

WORK = ("gemm", "cat")


def work(counts: dict, split_projections: int = 0) -> dict:
    """GEMMs and cats; with `split_projections`, what the unfused model runs for the fused model's `counts`: one GEMM
    more per `SplitProjection` (its column parts are separate contiguous copies, see surgery.core.split_projection)."""
    return {"gemm": counts["gemm"] + split_projections, "cat": counts["cat"]}


class Whole(unittest.TestCase):
    @parameterized.expand([(name,) for name in W.CASES])
    def test_unfused_does_the_fused_work(self, family):
        result = W.whole(family)
        self.assertEqual(work(result["unfused"]), work(result["fused"], result["split_projections"]))
        self.assertLessEqual(result["unfused_error"], FP32_TOL)

    def fused_and_unfused(self):
        family, config, fused = W.make("flux2")
        return fused, surgery.unfuse(copy.deepcopy(fused)), W.inputs(family, config)

    def test_lora_runs_the_parts(self):
        fused, unfused, kw = self.fused_and_unfused()
        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=["q", "attn_part", "up"],
                                           init_lora_weights=False), unfused)
        # the independent reference: each adapter's delta added to its rows / columns of the fused weight
        slices = {s.unfused: s for s in weight_slices(fused)}
        with torch.no_grad():
            for name, module in unfused.named_modules():
                if hasattr(module, "lora_A") and "default" in module.lora_A:
                    delta = module.lora_B["default"].weight @ module.lora_A["default"].weight
                    s = slices[f"{name}.weight"]
                    fused.get_parameter(s.fused).narrow(s.dim, s.start, s.size).add_(delta * module.scaling["default"])
        expected, got = W.counted(fused, kw), W.counted(unfused, kw)
        self.assertLessEqual(rel_err(got[1], expected[1]), FP32_TOL)
        self.assertGreater(got[0]["gemm"], expected[0]["gemm"])  # the parts' (and adapters') own GEMMs ran

    def test_hooked_part_runs_its_forward(self):
        fused, unfused, kw = self.fused_and_unfused()
        part = unfused.single_transformer_blocks[0].attn.to_qkv_mlp_proj.gate
        handle = part.register_forward_hook(lambda m, args, out: out * 2)
        with torch.no_grad():
            s = next(s for s in weight_slices(fused) if s.unfused.endswith("single_transformer_blocks.0.attn."
                                                                           "to_qkv_mlp_proj.gate.weight"))
            fused.get_parameter(s.fused).narrow(s.dim, s.start, s.size).mul_(2)
        self.assertLessEqual(rel_err(W.counted(unfused, kw)[1], W.counted(fused, kw)[1]), FP32_TOL)
        handle.remove()  # back to one GEMM per fused weight
        with torch.no_grad():
            fused.get_parameter(s.fused).narrow(s.dim, s.start, s.size).div_(2)
        self.assertEqual(work(W.counted(unfused, kw)[0]), work(W.counted(fused, kw)[0], W.split_projections(unfused)))

    def test_moved_weights(self):
        fused, unfused, kw = self.fused_and_unfused()
        unfused.double()  # each part's values move on their own; the leaves lay them out again
        kw64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()}
        expected = W.counted(fused.double(), kw64)
        got = W.counted(unfused, kw64)
        self.assertLessEqual(rel_err(got[1], expected[1]), FP32_TOL)
        self.assertEqual(work(got[0]), work(expected[0], W.split_projections(unfused)))
        # a part's values replaced behind the leaf's back: it runs its parts' own forwards, with the new values
        part = unfused.single_transformer_blocks[0].attn.to_qkv_mlp_proj.gate
        part.weight.data = part.weight.data * 2
        with torch.no_grad():
            s = next(s for s in weight_slices(fused) if s.unfused.endswith("single_transformer_blocks.0.attn."
                                                                           "to_qkv_mlp_proj.gate.weight"))
            fused.get_parameter(s.fused).narrow(s.dim, s.start, s.size).mul_(2)
        self.assertLessEqual(rel_err(W.counted(unfused, kw64)[1], W.counted(fused, kw64)[1]), FP32_TOL)

    def test_gradients_reach_the_parts(self):
        fused, unfused, kw = self.fused_and_unfused()
        grads = []
        for model in (fused, unfused):
            out = model(**kw, return_dict=False)[0]
            (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
        expected = unfuse_state_dict(grads[0], weight_slices(fused))
        leaves = [n for n, m in unfused.named_modules() if isinstance(m, (SplitRows, SplitProjection))]
        parts = [n for n in grads[1] if any(n.startswith(f"{leaf}.") for leaf in leaves)]
        self.assertTrue(parts)
        for name in parts:
            self.assertIsNotNone(grads[1][name], name)
            self.assertLessEqual(rel_err(grads[1][name], expected[name]), FP32_TOL, name)


class PerRank(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.ranks = run_on_cpu_ranks(W.all_per_rank, 2)
        cls.whole = {family: W.whole(family) for family in W.CASES}

    @parameterized.expand([(name,) for name in W.CASES])
    def test_each_rank_does_the_packed_work(self, family):
        for rank, result in enumerate(self.ranks):
            r = result[family]
            self.assertLessEqual(r["surgery_tp_error"], FP32_TOL, f"rank {rank}")
            # per rank as many GEMMs and cats as the fused model whole, which is what diffusers' packed TP runs (one
            # GEMM more per SplitProjection)
            n = self.whole[family]["split_projections"]
            self.assertEqual(work(r["surgery_tp"]), work(self.whole[family]["fused"], n), f"rank {rank}")
            if "packed_tp" in r:  # FLUX.3 has no diffusers `_tp_plan`
                self.assertEqual(work(r["surgery_tp"]), work(r["packed_tp"], n), f"rank {rank}")
                self.assertEqual(r["surgery_tp"]["collective"], r["packed_tp"]["collective"], f"rank {rank}")

    def test_fewest_all_reduces(self):
        # FLUX.2 and FLUX.1: 4 per double block (one per rowwise output projection of each stream's attention and
        # feed-forward), 1 per single block (attention + MLP summed in one projection); FLUX.3: 1 per mode block
        # (attention + feed-forward summed before the gate), 2 per joint single block (see rewrites/flux3.py)
        expected = {"flux2": 4 * 2 + 3, "flux1": 4 * 1 + 2, "flux3": 1 * 3 + 2 * 2}
        for rank, result in enumerate(self.ranks):
            for family, count in expected.items():
                self.assertEqual(result[family]["surgery_tp"]["collective"], count, f"{family}, rank {rank}")


if __name__ == "__main__":
    unittest.main()
