"""Inspection: rewrite tables, TP layouts planned under the fake process group, graphs, the plan/inspect commands."""

import contextlib
import io
import unittest

import torch
from parameterized import parameterized

import surgery
from flux2_testing import build, small_config
from surgery_rewrites.flux2 import VARIANTS
from surgery.sight import report, render
from surgery.app.cli import main


class RewriteTable(unittest.TestCase):
    def test_same_rows_fused_and_unfused(self):
        model = build(small_config("klein9b_small"))
        rows = report.rewrite_table(model)
        self.assertEqual(len(rows), 2 * 2 + 3 * 7)  # ff/ff_context: gate, up; single: q k v gate up + 2 columns
        self.assertEqual(rows[0]["takes"], "rows 0:192")
        self.assertEqual([r["takes"] for r in rows if r["copy"]][:2], ["columns 0:64", "columns 64:256"])
        surgery.unfuse(model)
        self.assertEqual(report.rewrite_table(model), rows)


class Plan(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.plan = report.plan("flux2-klein-9b", 8)

    def test_klein9b_tp8_bytes_per_rank(self):
        p = self.plan
        self.assertEqual(p["bytes_per_rank"], p["replicated_bytes"] + p["sharded_bytes"] // 8)
        self.assertAlmostEqual(p["bytes_per_rank"] / 1e9, 2.89, delta=0.01)
        self.assertEqual(p["model_bytes"], 2 * 9_078_581_248)

    def test_collectives_and_heads(self):
        c = self.plan["collectives"]
        self.assertEqual(c["ops"], {"all_reduce": 56})
        self.assertEqual(c["per_block"], {"transformer_blocks.*": 4, "single_transformer_blocks.*": 1})
        # each all-reduce carries [1, tokens, 4096] bf16: double blocks 2 x image + 2 x text, single blocks both
        per_token = 4096 * 2
        expected = 8 * (2 * 4096 + 2 * 512) * per_token + 24 * 4608 * per_token
        self.assertEqual(c["bytes"], expected)
        self.assertEqual(self.plan["heads"][:2], [(0, 4), (4, 8)])

    def test_text_report(self):
        text = render.plan_text("FLUX.2-klein-9b", self.plan)
        self.assertIn("single_transformer_blocks.*.attn.to_qkv_mlp_proj.q.weight", text)
        self.assertIn("56 all_reduce", text)


class Graphs(unittest.TestCase):
    def test_export_before_and_after(self):
        attn = build(small_config("klein4b_small")).single_transformer_blocks[0].attn
        x = torch.randn(1, 6, 48)
        rope = (torch.randn(6, 16), torch.randn(6, 16))
        before = report.export_graph(attn, (x,), {"image_rotary_emb": rope})
        after = report.export_graph(surgery.unfuse(attn), (x,), {"image_rotary_emb": rope})
        self.assertEqual([r["op"] for r in before if r["op"] in ("linear", "cat")], ["linear", "cat", "linear"])
        linears = [r["parameter"] for r in after if r["op"] == "linear"]
        self.assertEqual(sorted(linears), sorted([f"to_qkv_mlp_proj.{p}.weight" for p in ("q", "k", "v", "gate", "up")]
                                                 + ["to_out.attn_part.weight", "to_out.mlp_part.weight"]))
        self.assertEqual(after[-1]["op"], "add")  # the two column parts of to_out, summed

    def test_per_rank_local_graph_at_full_size(self):
        from diffusers import Flux2Transformer2DModel
        from torch.distributed.device_mesh import init_device_mesh

        with report.fake_process_group(8):
            with torch.device("meta"):
                model = Flux2Transformer2DModel(**VARIANTS["klein-9b"])
            surgery.tensor_parallel(surgery.unfuse(model), init_device_mesh("cpu", (8,)), src_data_rank=None)
            x = torch.empty(1, 64, 4096, device="meta")
            trace = report.module_trace(model.single_transformer_blocks[0].attn, x,
                                         image_rotary_emb=(torch.empty(64, 128, device="meta"),) * 2)
        by_path = {e["path"]: e for e in trace}
        self.assertEqual(by_path["to_qkv_mlp_proj.q"]["out"], (1, 64, 512))
        self.assertEqual(by_path["to_qkv_mlp_proj.gate"]["out"], (1, 64, 1536))
        self.assertTrue(by_path["to_out.attn_part"]["partial"] and by_path["to_out.mlp_part"]["partial"])
        self.assertEqual([e["path"] for e in trace if e["kind"] == "collective"], ["all_reduce"])
        self.assertEqual(trace[-1]["kind"], "collective")


def run(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


_BAD_CONFIGS = {
    "unknown_key": {"frobnication": 3},
    "zero_heads": {"num_attention_heads": 0},
    "negative_heads": {"num_attention_heads": -4},
    "other_family": {"_class_name": "UNet2DConditionModel"},
}


def _config_file(name: str) -> str:
    """A config.json of FLUX.2-klein-9B with one thing wrong."""
    import json
    import tempfile

    config = dict(VARIANTS["klein-9b"], _class_name="Flux2Transformer2DModel")
    config.update(_BAD_CONFIGS[name])
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(config, f)
    return f.name


class Commands(unittest.TestCase):
    def test_plan(self):
        code, out, _ = run("plan", "--model", "flux2-klein-4b", "--tp", "4", "--image-tokens", "256", "--text-tokens", "64")
        self.assertEqual(code, 0)
        self.assertIn("tensor parallel 4", out)
        self.assertIn("heads per rank: rank 0: 0-5", out)

    def test_inspect(self):
        code, out, _ = run("inspect", "--model", "flux2-dev")
        self.assertEqual(code, 0)
        self.assertIn("single_transformer_blocks.*.attn", out)
        self.assertIn("columns 6144:24576", out)

    @parameterized.expand([
        # its heads would be padded (pad_heads=True); its MLP's width cannot split over 5 either way
        (["plan", "--model", "flux2-klein-9b", "--tp", "5"], 1, "has 12288 output features, which a mesh of 5 cannot"),
        (["plan", "--config", "/nonexistent/config.json", "--tp", "2"], 1, "--config /nonexistent/config.json"),
        (["plan", "--config", "@unknown_key", "--tp", "2"], 1, "takes no argument 'frobnication'"),
        (["plan", "--config", "@zero_heads", "--tp", "2"], 1, "num_attention_heads=0; it must be at least 1"),
        (["inspect", "--config", "@negative_heads"], 1, "num_attention_heads=-4; it must be at least 1"),
        (["inspect", "--config", "@other_family"], 1, "_class_name 'UNet2DConditionModel' is no registered family"),
        (["plan", "--model", "flux1-schnell-xl", "--tp", "2"], 2, "invalid choice"),
        (["plan", "--model", "flux2-klein-9b"], 2, "the following arguments are required: --tp"),
    ])
    def test_bad_arguments(self, args, code, message):
        args = [_config_file(a[1:]) if a.startswith("@") else a for a in args]
        got, _, err = run(*args)
        self.assertEqual(got, code)
        self.assertIn(message, err.strip().splitlines()[-1])
