"""Plans defined once and composable: `effective_plan` is what `tensor_parallel` applies, a literal `plan=` (the one
`surgery plan --show-plan` prints) shards alike, `filter_fn` leaves the modules it drops whole, and a bad plan is
refused on every rank.

The real sharding runs on 2 gloo ranks (one job, `run_ranks`); the rest on the meta device.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import os
import tempfile
import unittest

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard  # noqa: F401  (names the printed plan uses)
from torch.distributed.tensor.parallel import (  # noqa: F401  (names the printed plan uses)
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

import surgery
from flux2_testing import build, inputs, small_config
from surgery.app.cli import main
from surgery.core.build import model_on_meta
from surgery.core.registry import tp_plans
from surgery.parallel.styles import under
from surgery.parallel.plans import effective_plan, plan_source, style_source, style_state
from surgery.testing import CollectiveCounter, rel_err, run_on_cpu_ranks
from surgery_rewrites.diffusers_common import DOUBLE_STREAM_ATTENTION_TP_PLAN
from surgery_rewrites.flux2 import FAMILY, FEED_FORWARD_TP_PLAN, PARALLEL_SELF_ATTENTION_TP_PLAN

CONFIG = "tp_wide"  # 2 double, 2 single blocks, 8 heads: splits over 2 ranks
from surgery.testing import FP32_TOL
NAMES = ("from torch.distributed.tensor import *; from torch.distributed.tensor.parallel import *; "
         "from surgery.parallel.styles import *; from surgery.parallel.derive import *")


def literal(text: str) -> dict:
    """The plan `--show-plan` printed, evaluated as a user's script would (star imports only)."""
    scope: dict = {}
    exec(NAMES, scope)
    return eval(text, scope)


def sources(plan: dict) -> dict[str, str]:
    return {key: style_source(style) for key, style in plan.items()}


@functools.lru_cache(maxsize=None)
def show_plan(config_name: str = CONFIG, *extra: str) -> str:
    """`surgery plan --config <the small FLUX.2 config> --show-plan`'s output."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            json.dump({"_class_name": "Flux2Transformer2DModel", **small_config(config_name)}, f)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["plan", "--config", path, "--show-plan", *extra])
    assert code == 0
    return out.getvalue()


# --- what each gloo rank runs ---------------------------------------------------------------------------------------


def _forward(model, kw):
    return model(**kw, return_dict=False)[0]


def layout(model) -> dict[str, tuple]:
    """Each parameter: a plain tensor and its shape, or a DTensor's placements and local shape."""
    return {name: ("dtensor", tuple(repr(p) for p in param.placements), tuple(param.to_local().shape))
            if isinstance(param, DTensor) else ("tensor", tuple(param.shape))
            for name, param in model.named_parameters()}


def expected_placements(model, plan: dict) -> dict[str, tuple[str, ...]]:
    """The placements the stock styles give the parameters `plan` names (written out here, not taken from surgery):
    colwise Linears shard weight and bias rows, rowwise ones weight columns with the bias whole, a per-head norm
    replicates its weight; module-level styles (PrepareModuleOutput) place nothing."""
    out = {}
    for key, style in plan.items():
        module = model.get_submodule(key)
        params = dict(module.named_parameters(recurse=False))
        for name in params:
            if isinstance(style, ColwiseParallel):
                placement = "Shard(dim=0)"
            elif isinstance(style, RowwiseParallel):
                placement = "Shard(dim=1)" if name == "weight" else "Replicate()"
            elif isinstance(style, SequenceParallel):
                placement = "Replicate()"
            else:
                continue
            out[f"{key}.{name}" if key else name] = (placement,)
    return out


def _refusal(fn) -> dict:
    try:
        fn()
    except surgery.SurgeryError as error:
        return {"error": str(error)}
    return {"error": None}


def run_ranks(rank: int, world: int, printed: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    config = small_config(CONFIG)
    fused = build(config, 3)
    kw = inputs(config, 3)
    out = {}
    with torch.no_grad():
        expected = _forward(fused, kw)
        for name, plan, filter_fn in [
            ("default", None, None),
            ("wildcard", literal(printed), None),
            ("filtered", None, lambda module, fqn: not fqn.startswith("single_transformer_blocks")),
        ]:
            model = surgery.unfuse(copy.deepcopy(fused))
            plan_before = effective_plan(model, plan=plan, filter_fn=filter_fn)
            surgery.tensor_parallel(model, mesh, plan, filter_fn)
            with CollectiveCounter() as counter:
                error = rel_err(_forward(model, kw), expected)
            out[name] = {"layout": layout(model), "forward": error, "collectives": dict(counter.counts),
                         "expected": expected_placements(model, plan_before), "keys": list(plan_before)}

        # sharded loading takes the same plan and filter: the same layout as tensor_parallel, read from a checkpoint
        with tempfile.TemporaryDirectory() as folder:
            fused.save_pretrained(folder)
            for name, plan, filter_fn in [
                ("loaded_filtered", None, lambda module, fqn: not fqn.startswith("single_transformer_blocks")),
                ("loaded_wildcard", literal(printed), None),
            ]:
                model = surgery.load_tensor_parallel(type(fused), folder, mesh, plan=plan, filter_fn=filter_fn,
                                                     progress=False)
                out[name] = {"layout": layout(model), "forward": rel_err(_forward(model, kw), expected)}

        def refuse(plan, filter_fn=None) -> dict:
            model = surgery.unfuse(copy.deepcopy(fused))
            result = _refusal(lambda: surgery.tensor_parallel(model, mesh, plan, filter_fn))
            return {**result, "untouched": not any(isinstance(p, DTensor) for p in model.parameters())}

        good = literal(printed)
        out["bad_key"] = refuse({**good, "transformer_blocks.*.attn.to_qq": ColwiseParallel()})
        out["bad_key_on_rank_1"] = refuse({**good, "attn.to_q": ColwiseParallel()} if rank == 1 else good)
        out["filter_on_rank_1"] = refuse(None, (lambda module, fqn: "single" not in fqn) if rank == 1 else None)
    return out


@functools.lru_cache(maxsize=None)
def rank_results() -> list[dict]:
    return run_on_cpu_ranks(run_ranks, 2, show_plan())


# --- the tests ------------------------------------------------------------------------------------------------------


class EffectivePlan(unittest.TestCase):
    def setUp(self):
        self.model = surgery.unfuse(model_on_meta(FAMILY, small_config(CONFIG)))

    def test_a_block_holds_its_children_plans_by_prefix(self):
        plan = effective_plan(self.model, "transformer_blocks.0")
        expected = {**under("attn", DOUBLE_STREAM_ATTENTION_TP_PLAN), **under("ff", FEED_FORWARD_TP_PLAN),
                    **under("ff_context", FEED_FORWARD_TP_PLAN)}
        self.assertEqual(sources(plan), sources(expected))
        self.assertEqual(style_source(plan["attn.to_q"]), "ColwiseParallel()")
        single = effective_plan(self.model, "single_transformer_blocks.1")
        self.assertEqual(sources(single), sources(under("attn", PARALLEL_SELF_ATTENTION_TP_PLAN)))
        self.assertEqual(style_source(single["attn.to_out.attn_part"]),
                         "RowwiseParallel(output_layouts=Partial(), use_local_output=False)")

    def test_the_model_plan_is_every_block_plan_under_its_path(self):
        flat = effective_plan(self.model)
        blocks = [f"{name}.{i}" for name in ("transformer_blocks", "single_transformer_blocks") for i in range(2)]
        composed = {f"{b}.{k}": s for b in blocks for k, s in effective_plan(self.model, b).items()}
        self.assertEqual(sources(flat), sources(composed))
        # fresh copies: editing the answer changes nothing registered
        self.assertIsNot(flat["transformer_blocks.0.attn.to_q"], DOUBLE_STREAM_ATTENTION_TP_PLAN["to_q"])

    def test_refusals(self):
        with self.assertRaisesRegex(surgery.SurgeryError, "no module 'transformer_blocks.9'"):
            effective_plan(self.model, "transformer_blocks.9")
        with self.assertRaisesRegex(surgery.SurgeryError, "still a fused .*Call surgery.unfuse"):
            effective_plan(model_on_meta(FAMILY, small_config(CONFIG)))

    def test_every_registered_style_has_a_faithful_literal(self):
        scope: dict = {}
        exec(NAMES, scope)
        for cls, plan in tp_plans().items():
            for key, style in plan.items():
                with self.subTest(cls=getattr(cls, "__name__", cls), key=key):
                    back = eval(style_source(style), scope)
                    self.assertIs(type(back), type(style))
                    self.assertEqual(style_state(back), style_state(style))
        self.assertEqual(literal(plan_source(DOUBLE_STREAM_ATTENTION_TP_PLAN)).keys(),
                         DOUBLE_STREAM_ATTENTION_TP_PLAN.keys())


class ShowPlan(unittest.TestCase):
    def test_prints_one_block_of_each_kind_as_valid_python(self):
        text = show_plan()
        plan = literal(text)
        model = surgery.unfuse(model_on_meta(FAMILY, small_config(CONFIG)))
        expected = {f"{kind}.*.{key}": style for kind in ("transformer_blocks", "single_transformer_blocks")
                    for key, style in effective_plan(model, f"{kind}.0").items()}
        self.assertEqual(sources(plan), sources(expected))
        self.assertIn('"single_transformer_blocks.*.attn.to_out.attn_part": '
                      'RowwiseParallel(output_layouts=Partial(), use_local_output=False),', text)
        self.assertIn("# transformer_blocks.*: 2 x Flux2TransformerBlock, as transformer_blocks.0", text)

    def test_checked_at_a_tp_size(self):
        self.assertIn("checked at --tp 4", show_plan(CONFIG, "--tp", "4"))
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit) as exit_:
            show_plan(CONFIG, "--tp", "3")
        self.assertEqual(exit_.exception.code, 1)
        line = stderr.getvalue().strip()
        self.assertEqual(len(line.splitlines()), 1)
        self.assertRegex(line, r"^surgery plan: .* 8 heads of 8, which a mesh of 3 cannot split")


class OnTwoRanks(unittest.TestCase):
    def test_effective_plan_is_what_tensor_parallel_applies(self):
        for rank, result in enumerate(rank_results()):
            for case in ("default", "wildcard", "filtered"):
                r = result[case]
                sharded = {n: v[1] for n, v in r["layout"].items() if v[0] == "dtensor"}
                with self.subTest(rank=rank, case=case):
                    self.assertEqual(sharded, r["expected"])  # every DTensor planned, every planned one a DTensor
                    self.assertLessEqual(r["forward"], FP32_TOL)

    def test_default_makes_the_family_all_reduces(self):
        config = small_config(CONFIG)
        for result in rank_results():
            self.assertEqual(result["default"]["collectives"], {"all_reduce": FAMILY.tp.all_reduces(config)})

    def test_printed_wildcard_plan_shards_like_the_registered_plans(self):
        for result in rank_results():
            self.assertEqual(result["wildcard"]["layout"], result["default"]["layout"])
            self.assertEqual(result["wildcard"]["keys"], result["default"]["keys"])
            self.assertEqual(result["wildcard"]["collectives"], result["default"]["collectives"])

    def test_filter_fn_leaves_the_modules_it_drops_whole(self):
        config = small_config(CONFIG)
        for result in rank_results():
            r = result["filtered"]
            singles = {n: v for n, v in r["layout"].items() if n.startswith("single_transformer_blocks")}
            self.assertTrue(singles)
            self.assertEqual({v[0] for v in singles.values()}, {"tensor"})
            rest = {n: v for n, v in r["layout"].items() if not n.startswith("single_transformer_blocks")}
            self.assertEqual(rest, {n: result["default"]["layout"][n] for n in rest})
            self.assertEqual(r["collectives"], {"all_reduce": 4 * config["num_layers"]})

    def test_sharded_loading_takes_the_same_plan_and_filter(self):
        for result in rank_results():
            for loaded, applied in (("loaded_filtered", "filtered"), ("loaded_wildcard", "wildcard")):
                with self.subTest(case=loaded):
                    self.assertEqual(result[loaded]["layout"], result[applied]["layout"])
                    self.assertLessEqual(result[loaded]["forward"], FP32_TOL)

    def test_a_bad_plan_is_refused_on_every_rank_and_changes_nothing(self):
        results = rank_results()
        for case, pattern in [
            ("bad_key", r"plan key 'transformer_blocks\.\*\.attn\.to_qq' matches no module"),
            ("bad_key_on_rank_1", r"plan key 'attn\.to_q' matches no module .*did you mean "
                                  r"'transformer_blocks\.\*\.attn\.to_q'"),
            ("filter_on_rank_1", r"the ranks hold different models.*rank 1 has 'plan'"),
        ]:
            errors = [r[case]["error"] for r in results]
            with self.subTest(case=case):
                for rank, (error, r) in enumerate(zip(errors, results)):
                    self.assertIsNotNone(error, f"rank {rank}")
                    self.assertRegex(error, pattern)
                    self.assertTrue(r[case]["untouched"])
                self.assertEqual(errors[0], errors[1])


if __name__ == "__main__":
    unittest.main()
