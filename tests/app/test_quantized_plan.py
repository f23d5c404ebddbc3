"""`surgery plan --quant`: per-rank GiB of every published variant at TP 1..8 with the block Linears quantized."""

import contextlib
import io
import unittest

import pytest
import torch

from surgery.app.cli import main
from surgery.core.registry import families
from surgery.sight import report
import surgery_rewrites  # noqa: F401  (registers the families)


def published() -> list[str]:
    """The published variants of every registered family (each one shards: the conformance suite runs it)."""
    return [family.model_name(variant) for family in families().values()
            for variant in family.variants]


class EveryVariant(unittest.TestCase):
    def test_int8_a_plain_and_a_convolutional_model_tp_1_to_8(self):
        self.check_int8(["flux2-klein-4b", "sana-600m-1024px"])

    @pytest.mark.heavy  # 130 variants built on meta and planned 8 times each (~1.5 min): CI's second run
    def test_int8_every_published_variant_tp_1_to_8(self):
        self.check_int8(published())

    def check_int8(self, names):
        for name in names:
            family, config = report.resolve_config(name)
            # bf16 bytes of every parameter (a model may keep some in fp32: count each at two bytes), and of the
            # Linear weights int8 halves (Sana's convolutions stay bf16)
            model = report.model_on_meta(family, config, torch.bfloat16)
            bf16 = 2 * sum(p.numel() for p in model.parameters())
            linear = 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
            rows = report.quantized_plan(name, range(1, 9), "int8")["rows"]
            self.assertEqual([r["tp"] for r in rows], list(range(1, 9)), name)
            for row in rows:
                self.assertTrue((row["bytes_per_rank"] is None) != (row["refused"] is None), (name, row))
            # TP 1 holds the whole model: Linear weights at one byte instead of two (plus a scale per row)
            whole = rows[0]["bytes_per_rank"]
            self.assertIsNotNone(whole, name)
            self.assertLess(whole, bf16 - 0.4 * linear, name)
            self.assertGreaterEqual(whole, bf16 - 0.5 * linear, name)
            # more ranks, fewer bytes each
            sizes = [r["bytes_per_rank"] for r in rows if r["bytes_per_rank"] is not None]
            self.assertEqual(sizes, sorted(sizes, reverse=True), name)

    def test_q4_refuses_a_column_cut_inside_a_256_block(self):
        # klein-4B's attention output has 24 x 128 = 3072 columns: 384 per rank at TP 8
        rows = {r["tp"]: r for r in report.quantized_plan("flux2-klein-4b", [4, 8], "q4")["rows"]}
        self.assertIsNotNone(rows[4]["bytes_per_rank"])
        self.assertIsNone(rows[8]["bytes_per_rank"])
        self.assertIn("384 columns per rank is not a multiple of q4's 256", rows[8]["refused"])


class Command(unittest.TestCase):
    def test_plan_quant_prints_gib_per_rank_at_tp_1_to_8(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["plan", "--model", "flux2-dev", "--quant", "fp8"])
        self.assertEqual(code, 0)
        lines = out.getvalue().splitlines()
        self.assertIn("GiB per rank", lines[0])
        self.assertEqual([line.split(":")[0].strip() for line in lines[1:]], [f"TP {n}" for n in range(1, 9)])
        self.assertIn("48 heads of 128, which a mesh of 5 cannot split", lines[5])  # TP 5

    def test_plan_quant_at_one_tp_matches_bf16_plan_minus_halved_linear_weights(self):
        bf16 = report.plan("flux2-klein-9b", 8)
        out = report.quantized_plan("flux2-klein-9b", [8], "fp8", dtype=torch.bfloat16)["rows"][0]["bytes_per_rank"]
        # FLUX.2's only 2-D weights are its Linears'
        linear = sum(r["bytes"] for r in bf16["layout"] if len(r["global shape"]) == 2)
        # fp8 halves each bf16 Linear weight a rank holds and adds a 4-byte scale per row of it
        self.assertLess(abs(out - (bf16["bytes_per_rank"] - linear / 2)) / out, 0.01)
