"""The `surgery` command: the README's main job runs, bad arguments exit non-zero with one line."""

import contextlib
import io
import os
import subprocess
import sys
import unittest
from unittest import mock

import pytest
from parameterized import parameterized

from surgery.app.cli import main


def surgery_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "surgery", *args], capture_output=True, text=True, timeout=600)


class Demo(unittest.TestCase):
    # 3 processes, ~20 s: CI's first step runs the README's `surgery demo` itself (.ci/run), its second the report here
    @pytest.mark.heavy
    def test_demo_runs_and_reports(self):
        result = surgery_command("demo", "--layers", "1", "--single-layers", "2", "--head-dim", "8")
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertIn("to_qkv_mlp_proj: SplitRows", result.stdout)
        self.assertIn("collectives per forward: 6 all_reduce", result.stdout)
        self.assertIn("OK: worst error", result.stdout)

    @pytest.mark.heavy  # a second demo (~25 s, the same user path as the one above): CI's second run
    def test_flux3_demo(self):
        # the family added the new way (leaves and a head-dim processor twin) runs the same user path
        result = surgery_command("demo", "--model", "flux3")
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertIn("linear_in: SplitRows", result.stdout)
        self.assertIn("processor: HeadDimFlux3AttnProcessor", result.stdout)
        # the demo's shape, 1 mode block + 4 single blocks with reference tokens: 1 all-reduce per mode (text, image,
        # reference) of the mode block, 2 per single block, written here from the plan's intent
        self.assertIn("collectives per forward: 11 all_reduce", result.stdout)
        self.assertIn("OK: worst error", result.stdout)


class BadArguments(unittest.TestCase):
    @parameterized.expand([
        (["demo", "--tp", "5"], "--tp 5 does not divide the 24 heads of flux2-klein-4b"),
        (["demo", "--model", "flux2-klein-9b", "--tp", "5"], "--tp 5 does not divide the 32 heads of flux2-klein-9b"),
        (["demo", "--head-dim", "12"], "head_dim 12 is not a multiple of 8"),
        (["demo", "--tp", "0"], "must be at least 1"),
        (["demo", "--model", "flux9"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
        (["plan", "--model", "flux2-klein-9b"], "the following arguments are required: --tp"),
        (["plan", "--show-plan", "--pipeline", "--json"], "--show-plan prints the plan alone: drop --pipeline, --json"),
    ])
    def test_exit_two_with_one_line(self, args, message):
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit) as exit_:
            main(args)
        self.assertEqual(exit_.exception.code, 2)
        self.assertIn(message, stderr.getvalue().strip().splitlines()[-1])


class HelpAndNames(unittest.TestCase):
    """`--model`'s names: generated from the registry without doubled words, listed by family in the help without a
    name broken at a hyphen, and an alias that two families could mean refused with both."""

    def test_names(self):
        from surgery.core.registry import model_names, resolve_model

        names = model_names()
        self.assertIn("bria-fibo", names)
        self.assertNotIn("bria-fibo-fibo", names)
        self.assertEqual(len(names), len(set(names)))
        self.assertNotIn("dev", names)  # flux1-dev or flux2-dev
        self.assertEqual(resolve_model("flux2-klein-9b")[1], "klein-9b")
        self.assertNotIn("klein-9b", names)  # one name per thing: no short aliases
        self.assertEqual(resolve_model("bria-fibo")[0].name, "bria-fibo")


class Output(unittest.TestCase):
    def run_main(self, *args):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(list(args))
        return code, out.getvalue()

    def test_inspect_plans_only_family(self):
        code, out = self.run_main("inspect", "--model", "qwen-image")
        self.assertEqual(code, 0)
        self.assertIn("plans only", out)
        self.assertNotIn("(nothing)", out)

    def test_plan_words_units_and_small_tensors(self):
        code, out = self.run_main("plan", "--model", "flux2-klein-9b", "--tp", "8", "--image-tokens", "256",
                                  "--text-tokens", "64")
        self.assertEqual(code, 0)
        self.assertIn("per rank 2.69 GiB = 676.0 MiB replicated + 16.25 GiB sharded / 8", out)
        table = out.split("\n\n")[1].splitlines()
        for word in ("Shard(0)", "Shard(1)", "Replicate", " whole ", " MB", " GB", "0.0 MB"):
            self.assertNotIn(word, "\n".join(table[:-2]))  # the last two lines explain the words
            if word.strip() in ("MB", "GB", "Shard(0)", "Replicate"):
                self.assertNotIn(word, out)
        small = [line for line in table if "under 1.0 MiB each" in line]
        self.assertEqual(len(small), 1)
        self.assertIn("80", small[0])  # 2 x 8 double-block + 2 x 24 single-block norms + 16 added q/k norms
        self.assertFalse([line for line in table if "norm_q" in line or "norm_k" in line])
        self.assertIn("colwise (rows)", out)
        self.assertIn("rowwise (columns)", out)

    def test_plan_names_what_a_family_keeps_whole_on_purpose_and_its_bytes(self):
        # Sana's conv feed-forward: no stock style shards a Conv2d, so every rank holds it whole; the plan says why
        # and how much. Per block (600M: width 1152, mlp_ratio 2.5): 1x1 up to 2 x 2880 channels with bias, depthwise
        # 3x3 with bias, 1x1 down without; 28 blocks in bf16
        code, out = self.run_main("plan", "--model", "sana-600m-1024px", "--tp", "4", "--image-tokens", "256",
                                  "--text-tokens", "64")
        self.assertEqual(code, 0)
        dim, hidden = 1152, 2880
        per_block = dim * 2 * hidden + 2 * hidden + 2 * hidden * 9 + 2 * hidden + hidden * dim
        whole = out.split("whole on every rank on purpose:\n")[1].split("\n\n")[0]
        self.assertIn("transformer_blocks.*.ff.conv_inverted", whole)
        self.assertIn(f"({28 * per_block * 2 / 2**20:.1f} MiB per rank): a Conv2d feed-forward", whole)

    def test_show_plan_prints_a_literal_plan_of_one_block_per_kind(self):
        code, out = self.run_main("plan", "--model", "flux1-dev", "--show-plan")
        self.assertEqual(code, 0)
        scope: dict = {}
        exec("from torch.distributed.tensor import *; from torch.distributed.tensor.parallel import *; "
             "from surgery.parallel.styles import *", scope)
        plan = eval(out, scope)  # the whole output is valid Python: comments and one dict
        self.assertEqual(type(plan["transformer_blocks.*.attn.to_q"]).__name__, "ColwiseParallel")
        self.assertIn('"single_transformer_blocks.*.proj_out.attn_part": '
                      "RowwiseParallel(output_layouts=Partial(), use_local_output=False),", out)
        self.assertIn("# single_transformer_blocks.*: 38 x FluxSingleTransformerBlock, as single_transformer_blocks.0",
                      out)
        self.assertEqual({key.split(".")[0] for key in plan}, {"transformer_blocks", "single_transformer_blocks"})
