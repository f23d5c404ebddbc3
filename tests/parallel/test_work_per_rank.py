"""Per forward, the unfused model does the fused model's work and, per rank, diffusers' packed TP's: GEMMs and cats
counted with a TorchDispatchMode (`surgery.testing.CollectiveCounter`), whole and on 2 gloo ranks, in the steady
state (the first forward run for inference lays each SplitProjection's columns out in one buffer, once). Where a part
does more than a plain matmul (LoRA, a hook, moved weights, gradients) the parts' own forwards run, and the values
say so; `train()` gives the column parts contiguous values again, which FSDP2 needs."""

import copy
import unittest

import torch
from parameterized import parameterized
from peft import LoraConfig, inject_adapter_in_model

import surgery
from surgery.core.split_projection import SplitProjection, SplitRows
from surgery.state_dict import unfuse_state_dict, weight_slices
from surgery.testing import FP32_GRAD_TOL, rel_err, run_on_cpu_ranks, single_rank_group

import work_per_rank_worker as W
from conformance_worker import FP32_TOL

WORK = ("gemm", "cat")
ROW_PART = "single_transformer_blocks.0.attn.to_qkv_mlp_proj.gate"
COLUMN_PART = "single_transformer_blocks.0.attn.to_out.mlp_part"  # FLUX.2's single-block SplitProjection


def work(counts: dict) -> dict:
    return {key: counts[key] for key in WORK}


def scale_in_fused(fused, part: str, factor: float) -> None:
    """The independent reference of a part scaled by `factor`: its rows / columns of the fused weight scaled."""
    with torch.no_grad():
        s = next(s for s in weight_slices(fused) if s.unfused == f"{part}.weight")
        fused.get_parameter(s.fused).narrow(s.dim, s.start, s.size).mul_(factor)


def column_views(model) -> int:
    """How many parameters of `model` are non-contiguous (packed column parts)."""
    return sum(not p.is_contiguous() for p in model.parameters())


class Whole(unittest.TestCase):
    @parameterized.expand([(name,) for name in W.CASES])
    def test_unfused_does_the_fused_work(self, family):
        result = W.whole(family)
        self.assertEqual(work(result["unfused"]), work(result["fused"]))
        self.assertLessEqual(result["unfused_error"], FP32_TOL)

    def fused_and_unfused(self):
        family, config, fused = W.make("flux2")
        return fused, surgery.unfuse(copy.deepcopy(fused)), W.inputs(family, config)

    def test_columns_packed_only_for_inference(self):
        fused, unfused, kw = self.fused_and_unfused()
        n = W.split_projections(unfused)
        self.assertEqual(column_views(unfused), 0)  # unfused, not yet run: what fully_shard takes
        expected = W.counted(fused, kw)
        out = unfused(**kw, return_dict=False)[0]  # autograd on: nothing packed, the parts' own forwards
        self.assertLessEqual(rel_err(out, expected[1]), FP32_TOL)
        self.assertEqual(column_views(unfused), 0)
        # the first forward for inference (eval mode, autograd off) lays the columns out: one cat each, once
        got = W.counted(unfused, kw, warm=False)
        self.assertEqual(work(got[0]), {"gemm": expected[0]["gemm"], "cat": expected[0]["cat"] + n})
        self.assertEqual(column_views(unfused), 2 * n)
        self.assertLessEqual(rel_err(got[1], expected[1]), FP32_TOL)
        got = W.counted(unfused, kw, warm=False)
        self.assertEqual(work(got[0]), work(expected[0]))
        self.assertLessEqual(rel_err(got[1], expected[1]), FP32_TOL)
        unfused.train()  # each column part its own contiguous values again
        self.assertEqual(column_views(unfused), 0)
        with torch.no_grad():
            self.assertLessEqual(rel_err(unfused(**kw, return_dict=False)[0], expected[1]), FP32_TOL)
        self.assertEqual(column_views(unfused), 0)  # a training-mode forward packs nothing

    def test_fsdp2_takes_the_model_after_train(self):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fused, unfused, kw = self.fused_and_unfused()
        refused = surgery.unfuse(copy.deepcopy(fused))
        with single_rank_group():
            mesh = init_device_mesh("cpu", (1,))
            with torch.no_grad():
                unfused(**kw, return_dict=False)
                refused(**kw, return_dict=False)
            with self.assertRaisesRegex(NotImplementedError, "non-contiguous"):  # why train() unpacks
                fully_shard(refused, mesh=mesh)
            fully_shard(unfused.train(), mesh=mesh)
            out = unfused(**kw, return_dict=False)[0]
        with torch.no_grad():
            self.assertLessEqual(rel_err(out, fused(**kw, return_dict=False)[0]), FP32_TOL)

    def test_lora_runs_the_parts(self):
        fused, unfused, kw = self.fused_and_unfused()
        W.counted(unfused, kw)  # packed first: the adapters wrap parts whose values are views of one buffer
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

    @parameterized.expand([("rows", ROW_PART), ("columns", COLUMN_PART)])
    def test_hooked_part_runs_its_forward(self, _, path):
        fused, unfused, kw = self.fused_and_unfused()
        W.counted(unfused, kw)
        handle = unfused.get_submodule(path).register_forward_hook(lambda m, args, out: out * 2)
        scale_in_fused(fused, path, 2)
        self.assertLessEqual(rel_err(W.counted(unfused, kw)[1], W.counted(fused, kw)[1]), FP32_TOL)
        handle.remove()  # back to one GEMM per fused weight
        scale_in_fused(fused, path, 0.5)
        self.assertEqual(work(W.counted(unfused, kw)[0]), work(W.counted(fused, kw)[0]))

    @parameterized.expand([("rows", ROW_PART), ("columns", COLUMN_PART)])
    def test_moved_weights(self, _, path):
        fused, unfused, kw = self.fused_and_unfused()
        W.counted(unfused, kw)
        unfused.double()  # each part's values move on their own; the leaves lay them out again
        kw64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()}
        expected = W.counted(fused.double(), kw64)
        got = W.counted(unfused, kw64, warm=False)
        self.assertLessEqual(rel_err(got[1], expected[1]), FP32_TOL)
        self.assertEqual(work(got[0]), work(expected[0]))
        # a part's values replaced behind the leaf's back: it runs its parts' own forwards, with the new values
        part = unfused.get_submodule(path)
        part.weight.data = part.weight.data * 2
        scale_in_fused(fused, path, 2)
        self.assertLessEqual(rel_err(W.counted(unfused, kw64)[1], W.counted(fused, kw64)[1]), FP32_TOL)

    def test_gradients_reach_the_parts(self):
        fused, unfused, kw = self.fused_and_unfused()
        W.counted(unfused, kw)  # packed: gradients flow through the parts' own forwards (column views) all the same
        grads = []
        for model in (fused, unfused):
            out = model(**kw, return_dict=False)[0]
            (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
        expected = unfuse_state_dict(grads[0], weight_slices(fused))
        leaves = [n for n, m in unfused.named_modules() if isinstance(m, (SplitRows, SplitProjection))]
        parts = [n for n in grads[1] if any(n.startswith(f"{leaf}.") for leaf in leaves)]
        self.assertTrue(any(".to_out." in n for n in parts))
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
        if family != "flux3":  # FLUX.3's blocks sum attention and feed-forward without a concatenation
            self.assertGreater(self.whole[family]["split_projections"], 1)
        for rank, result in enumerate(self.ranks):
            r = result[family]
            self.assertLessEqual(r["surgery_tp_error"], FP32_TOL, f"rank {rank}")
            # per rank as many GEMMs and cats as the fused model whole, which is what diffusers' packed TP runs
            self.assertEqual(work(r["surgery_tp"]), work(self.whole[family]["fused"]), f"rank {rank}")
            if "packed_tp" in r:  # FLUX.3 has no diffusers `_tp_plan`
                self.assertEqual(work(r["surgery_tp"]), work(r["packed_tp"]), f"rank {rank}")
                self.assertEqual(r["surgery_tp"]["collective"], r["packed_tp"]["collective"], f"rank {rank}")

    def test_flux3_under_both_call_conventions(self):
        # diffusers calls FLUX.3's joint single blocks by keyword at inference and positionally under gradient
        # checkpointing: the same all-reduces (1 per mode block, 2 per joint single block) and bytes either way
        for rank, result in enumerate(self.ranks):
            r = result["flux3_conventions"]
            self.assertEqual(r["keyword"]["calls"], ["keyword"], f"rank {rank}")
            self.assertEqual(r["positional"]["calls"], ["positional"], f"rank {rank}")
            for convention in ("keyword", "positional"):
                self.assertEqual(r[convention]["all_reduces"], 1 * 3 + 2 * 2, f"{convention}, rank {rank}")
                self.assertLessEqual(r[convention]["error"], FP32_TOL, f"{convention}, rank {rank}")
            self.assertEqual(r["keyword"]["bytes"], r["positional"]["bytes"], f"rank {rank}")
            self.assertEqual(r["positional"]["grads"], r["positional"]["parameters"], f"rank {rank}")
            self.assertLessEqual(r["positional"]["grad_error"], FP32_GRAD_TOL, f"rank {rank}")

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
