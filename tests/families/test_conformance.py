"""The conformance suite: every registered model family gets these checks by registering, not by copying tests.

For each family with variants and test configs: unfused == fused (forward and backward, fp32 tight, bf16 loose, two
seeds), row slices are views, `fuse` restores stock classes bitwise, the slices tile every fused parameter, builders
never mutate their argument, every published variant rewrites on meta with the same parameter count, sharding at 8
ranks on meta holds replicated + sharded/8 bytes; then real gloo jobs (world 2 and world 4, one test config per
family) against the single-device fused model: forward and gathered gradients, collectives per forward (exactly the
family's declared all-reduces, never more than diffusers' packed plan), per-rank bytes, sharded loading and
`surgery convert` through the same slice tables.
"""

from __future__ import annotations

import copy
import functools
import math
import shutil
import tempfile
import unittest
from pathlib import Path

import pytest
import torch
from parameterized import parameterized
from safetensors.torch import load_file

import conformance_worker as W
import surgery
from surgery.parallel.distributed import fake_process_group
from surgery.sight.report import local_bytes
from surgery.core.build import model_on_meta
from surgery.core.registry import model_class
from surgery.core.slicing import group_by_fused
from surgery.testing import rel_err, run_on_cpu_ranks
from surgery.core.walk import find_modules
from surgery.parallel.derive import KEYS, head_count, query_projection, whole_key_values

CASES = W.family_cases()
TP_CASES = W.family_cases(tp_only=True)
FAMILIES = [(f.name,) for f in W.conformant_families()]
VARIANTS = [(f.name, v) for f in W.conformant_families() for v in f.variants]
ROOT = Path(tempfile.mkdtemp(prefix="surgery-conformance-"))


def tearDownModule():
    shutil.rmtree(ROOT, ignore_errors=True)


def _name(func, num, params):
    return f"{func.__name__}_{'_'.join(str(a).replace('-', '_') for a in params.args)}"


@functools.lru_cache(maxsize=None)
def fused_checkpoint(family_name: str, config_name: str) -> str:
    """A fused diffusers checkpoint of the case's seeded model (`W.case_seed`), sharded in two files."""
    seed = W.case_seed(family_name, config_name)
    _, _, model = W.make(family_name, config_name, seed)
    folder = ROOT / f"{family_name}-{config_name}"
    size = sum(p.nbytes for p in model.parameters())
    model.save_pretrained(folder, max_shard_size=f"{size // 2 // 1000 + 1}KB")
    return str(folder)


@functools.lru_cache(maxsize=None)
def tp_results(world: int) -> list[dict]:
    cases = TP_CASES  # one test config per family, at world 2 and at world 4
    checkpoints = {}
    if world == 2:
        for family_name, config_name in TP_CASES:
            seed = W.case_seed(family_name, config_name)
            checkpoints[f"{family_name}/{config_name}"] = (seed, fused_checkpoint(family_name, config_name))
    # one seed per case, the same on every rank (read off the case's name)
    return run_on_cpu_ranks(W.run, world, cases, checkpoints)


@functools.lru_cache(maxsize=None)
def plans_only(family_name: str) -> bool:
    """No rewrite of the family's own and nothing fused in its model: a class another family rewrites (a diffusers
    `FeedForward` with a SwiGLU, split by rewrites/ovis_image.py) makes a family without rewrites fuse something."""
    family = W.families()[family_name]
    return not family.rewrites and not find_modules(model_on_meta(family, family.config()), fused=True)


def skip_plans_only(test: unittest.TestCase, family_name: str) -> None:
    """A plans-only family (nothing fused: qwen-image, qwen-image-2.1) has nothing to unfuse, so an unfused-vs-fused
    comparison would compare the model with its own copy, and a loop over its fused modules would run over nothing.
    `PlansOnly` checks what such a family does have: its plans, against diffusers'."""
    if plans_only(family_name):
        test.skipTest(f"{family_name} fuses nothing (plans only): nothing to unfuse; see PlansOnly")


class EveryFamily(unittest.TestCase):
    @parameterized.expand([(f.name,) for f in W.families().values() if f.variants and W.chosen(f.name)],
                          name_func=_name)
    def test_is_run_by_this_suite(self, family_name):
        # the README, docs/families.md and `surgery families` list a family as sharded only if this suite runs it
        self.assertTrue(W.families()[family_name].tests.configs,
                        f"{family_name} registers published variants but no test configs, so this suite never runs "
                        "it and nothing proves it shards: add test_configs (its structure at tiny widths)")
        self.assertIn(family_name, {name for name, _ in TP_CASES})


class Equivalence(unittest.TestCase):
    @parameterized.expand(CASES, name_func=_name)
    def test_forward_and_backward_fp32(self, family_name, config_name):
        skip_plans_only(self, family_name)
        for seed in (0, 1):
            family, config, fused = W.make(family_name, config_name, seed)
            unfused = surgery.unfuse(copy.deepcopy(fused))
            kw = W.inputs(family, config, seed)
            with torch.no_grad():
                self.assertLessEqual(rel_err(W.output(unfused, kw), W.output(fused, kw)), W.FP32_TOL)
            with W.flex_as(family.tests.flex_backward):  # flex attention has no backward on CPU
                (ref_in, ref), (got_in, got) = W.gradients(fused, kw, seed), W.gradients(unfused, kw, seed)
            got = surgery.state_dict.fuse_state_dict(got, surgery.state_dict.weight_slices(unfused))
            self.assertEqual(sorted(got), sorted(ref))
            for name, error in W.gradient_errors(got, ref).items():
                self.assertLessEqual(error, W.FP32_GRAD_TOL, name)
            for name, grad in ref_in.items():
                self.assertLessEqual(rel_err(got_in[name], grad), W.FP32_GRAD_TOL, name)

    @parameterized.expand(CASES, name_func=_name)
    def test_forward_bf16(self, family_name, config_name):
        skip_plans_only(self, family_name)
        family, config, fused = W.make(family_name, config_name, 2, torch.bfloat16)
        unfused = surgery.unfuse(copy.deepcopy(fused))
        kw = W.inputs(family, config, 2, torch.bfloat16)
        with torch.no_grad():
            self.assertLessEqual(rel_err(W.output(unfused, kw), W.output(fused, kw)), W.BF16_TOL)


class Structure(unittest.TestCase):
    @parameterized.expand(TP_CASES, name_func=_name)
    def test_row_slices_are_views_and_fuse_is_bitwise_with_stock_classes(self, family_name, config_name):
        skip_plans_only(self, family_name)
        _, _, fused = W.make(family_name, config_name)
        original = copy.deepcopy(fused)
        before = dict(fused.named_parameters())
        slices = surgery.state_dict.weight_slices(fused)
        surgery.unfuse(fused)
        after = dict(fused.named_parameters())
        for s in slices:
            if s.dim == 0:
                self.assertEqual(after[s.unfused].untyped_storage().data_ptr(),
                                 before[s.fused].untyped_storage().data_ptr(), s.unfused)
        self.assertEqual(find_modules(fused, fused=True), [])
        surgery.fuse(fused)
        self.assertEqual([(n, type(m)) for n, m in fused.named_modules()],
                         [(n, type(m)) for n, m in original.named_modules()])
        fused_state, original_state = fused.state_dict(), original.state_dict()
        self.assertEqual(list(fused_state), list(original_state))
        for key, value in original_state.items():
            self.assertTrue(torch.equal(fused_state[key], value), key)

    @parameterized.expand(TP_CASES, name_func=_name)
    def test_slices_tile_each_fused_parameter_exactly(self, family_name, config_name):
        skip_plans_only(self, family_name)
        _, _, fused = W.make(family_name, config_name)
        for path, module, rewrite in find_modules(fused, fused=True):
            params = dict(module.named_parameters())
            for name, group in group_by_fused(rewrite.slices(module)):
                edges = [(s.start, s.stop) for s in group]
                self.assertEqual(edges[0][0], 0, f"{path}.{name}")
                self.assertTrue(all(a[1] == b[0] for a, b in zip(edges, edges[1:])), f"{path}.{name}: {edges}")
                self.assertEqual(edges[-1][1], params[name].shape[group[0].dim], f"{path}.{name}")

    @parameterized.expand(TP_CASES, name_func=_name)
    def test_builders_never_mutate_their_argument(self, family_name, config_name):
        skip_plans_only(self, family_name)
        _, _, fused = W.make(family_name, config_name)
        unfused = surgery.unfuse(copy.deepcopy(fused))
        for model, is_fused in ((fused, True), (unfused, False)):
            for path, module, rewrite in find_modules(model, fused=is_fused):
                snap = surgery.testing.snapshot(module)
                attributes = {k: v for k, v in vars(module).items() if not k.startswith("_")}
                (rewrite.build_unfused if is_fused else rewrite.build_fused)(module)
                surgery.testing.assert_unchanged(module, snap)
                self.assertEqual({k: v for k, v in vars(module).items() if not k.startswith("_")}, attributes, path)


PLANS_ONLY = [(f.name,) for f in W.conformant_families() if plans_only(f.name)]


class PlansOnly(unittest.TestCase):
    @parameterized.expand(PLANS_ONLY, name_func=_name, skip_on_empty=True)  # empty under SURGERY_FAMILIES
    def test_nothing_to_unfuse_and_the_plans_are_diffusers(self, family_name):
        from surgery.integration.interop import diffusers_tp_plan

        family = surgery.extend.families()[family_name]
        for variant in family.variants:
            model = model_on_meta(family, family.config(variant))
            snap = [(n, id(m), type(m)) for n, m in model.named_modules()]
            self.assertEqual(find_modules(model, fused=True), [], "a plans-only family fuses nothing")
            self.assertEqual(surgery.state_dict.weight_slices(model), [])
            surgery.unfuse(model)
            self.assertEqual(surgery.core.rewrite.last_report(model), [], "unfuse rewrote something")
            self.assertEqual([(n, id(m), type(m)) for n, m in model.named_modules()], snap)
            # the plans this family registers shard exactly the Linears diffusers' own `_tp_plan` shards, alike
            # (where diffusers has one: Krea2's and Ideogram4's plans are derived, and proven by the sharded runs)
            if getattr(type(model), "_tp_plan", None) is not None:
                self.assertEqual(diffusers_tp_plan(model), type(model)._tp_plan, f"{family_name}-{variant}")


@pytest.mark.heavy  # published widths, on meta: every variant built and every family planned at TP 8 (CI's second run)
class FullSize(unittest.TestCase):
    @parameterized.expand(VARIANTS, name_func=_name)
    def test_published_variant_rewrites_on_meta(self, family_name, variant):
        family = surgery.extend.families()[family_name]
        model = model_on_meta(family, family.config(variant))
        count = sum(p.numel() for p in model.parameters())
        fused = len(find_modules(model, fused=True))
        surgery.unfuse(model)
        self.assertEqual(len(surgery.core.rewrite.last_report(model)), fused)
        self.assertEqual(find_modules(model, fused=True), [])
        self.assertEqual(sum(p.numel() for p in model.parameters()), count)
        surgery.fuse(model)
        self.assertEqual(sum(p.numel() for p in model.parameters()), count)

    @parameterized.expand(FAMILIES, name_func=_name)
    def test_default_variant_at_tp8_holds_replicated_plus_sharded_over_tp(self, family_name):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor

        family = surgery.extend.families()[family_name]
        config = family.config()
        model = surgery.unfuse(model_on_meta(family, config, torch.bfloat16))
        # the heads every attention splits, query and key/value, read off the model (Z-Image's 30 split over 2 at
        # most, Stable Audio's 12 key/value heads over 4)
        heads = math.gcd(*(n for m in model.modules() for n in head_counts(m)), 0) or 8
        tp = next(n for n in (8, 4, 2) if heads % n == 0)  # HunyuanImage's 28 heads split over 4 at most
        with fake_process_group(tp):
            whole = {n: p.nbytes for n, p in model.named_parameters()}
            surgery.tensor_parallel(model, init_device_mesh("cpu", (tp,)), src_data_rank=None)
            sharded = {n for n, p in model.named_parameters() if isinstance(p, DTensor) and p.placements[0].is_shard()}
            per_rank = local_bytes(model)
        expected = sum(b for n, b in whole.items() if n not in sharded) + sum(whole[n] for n in sharded) // tp
        self.assertEqual(per_rank, expected)
        # the blocks' projections; FLUX.1-dev (72% sharded), QwenImage (66%), HunyuanVideo, LongCat, Bria (72%) keep
        # their per-block AdaLN modulation Linears whole, as diffusers' own plans do: sharding them would add an
        # all-gather each, more collectives than diffusers' plan; DiT's adaLN-Zero (6 x width per block) is ~40%.
        # What the family declares whole with its reason (`replicated`: Sana's conv feed-forward, half its bytes) is
        # reported by `surgery plan`, not counted against it; everything else must be mostly sharded.
        declared = declared_whole(model, family)
        self.assertTrue(declared.isdisjoint(sharded), sorted(declared & sharded)[:3])
        self.assertGreater(sum(whole[n] for n in sharded),
                           0.55 * sum(b for n, b in whole.items() if n not in declared))


def head_counts(module: torch.nn.Module) -> list[int]:
    """An attention's query heads and its key projection's heads (fewer under grouped-query attention), where the
    plan splits them (a multi-query attention's one key/value head stays whole)."""
    heads, query = head_count(module), query_projection(module)
    if heads is None:
        return []
    if query is None:  # projections named the model's own way (SANA-WM's `qkv`, `q_linear`): its heads as stored
        return [heads]
    whole = whole_key_values(module)
    key = next((k for k in (getattr(module, name, None) for name in KEYS if name not in whole)
                if isinstance(k, torch.nn.Linear)), None)
    return [heads] + ([key.out_features // (query.out_features // heads)] if key is not None else [])


def declared_whole(model: torch.nn.Module, family) -> set[str]:
    """The parameters of the modules a family declares whole on every rank (`TensorParallel.replicated`: class -> {path
    pattern relative to the class's module: reason})."""
    from fnmatch import fnmatchcase

    from surgery.core.registry import qualified_name

    names: set[str] = set()
    for path, module in model.named_modules():
        patterns = {**family.tp.replicated.get(qualified_name(type(module)), {}), **family.tp.replicated.get(type(module), {})}
        for key, child in module.named_modules():
            if key and any(fnmatchcase(key, pattern) for pattern in patterns):
                names |= {".".join(p for p in (path, key, n) if p) for n, _ in child.named_parameters()}
    return names


def assert_gradients(test: unittest.TestCase, r: dict, tolerance: float, where: str) -> None:
    """The sharded gradients within the bound of the stock model's; or, where they are not, within `ROUNDING_SPREAD`
    times the stock float32 model's own distance from the float64 computation (`W.float64_errors`): rounding, not a
    wrong cut, which would be as far from float64 as from stock."""
    if max(r["param_grads"], r["input_grads"]) <= tolerance:
        return
    test.assertIn("float64", r, where)
    sharded, stock = r["float64"]["sharded"], r["float64"]["stock"]
    test.assertLessEqual(sharded, max(tolerance, W.ROUNDING_SPREAD * stock),
                         f"{where}: gradients {max(r['param_grads'], r['input_grads']):.2e} from the stock model's, "
                         f"{sharded:.2e} from float64, where the stock model's are {stock:.2e} from float64")


class TensorParallel(unittest.TestCase):
    @parameterized.expand([(2, *c) for c in TP_CASES], name_func=_name)
    def test_matches_single_device_fused_model(self, world, family_name, config_name):
        results = tp_results(world)
        key = f"{family_name}/{config_name}"
        for rank, by_case in enumerate(results):
            r = by_case[key]
            self.assertGreater(r["sharded_params"], 0)
            self.assertLessEqual(r["forward"], W.FP32_TOL, f"rank {rank}")
            self.assertTrue(r["grad_keys_match"])
            assert_gradients(self, r, W.grad_tolerance(W.families()[family_name]), f"{key} rank {rank}")
            self.assertEqual(r["bytes"], r["expected_bytes"])
            if r["expected_all_reduces"] is not None:
                self.assertEqual(r["collectives"], {"all_reduce": r["expected_all_reduces"]})
            if "diffusers_collectives" in r:
                self.assertLessEqual(r["diffusers_forward"], W.FP32_TOL)  # their plan is a fair baseline
                self.assertLessEqual(sum(r["collectives"].values()), sum(r["diffusers_collectives"].values()))

    @pytest.mark.heavy  # 4 spawned ranks: CI runs it second (tests/conftest.py)
    def test_world_4(self):
        for by_case in tp_results(4):
            for key, r in by_case.items():
                self.assertLessEqual(r["forward"], W.FP32_TOL, key)
                assert_gradients(self, r, W.grad_tolerance(W.families()[key.partition("/")[0]]), key)
                self.assertEqual(r["bytes"], r["expected_bytes"], key)
                if r["expected_all_reduces"] is not None:
                    self.assertEqual(r["collectives"], {"all_reduce": r["expected_all_reduces"]}, key)

    @parameterized.expand(TP_CASES, name_func=_name)
    def test_sharded_load_is_bitwise_unfuse_then_tensor_parallel(self, family_name, config_name):
        for by_case in tp_results(2):
            self.assertEqual(by_case[f"{family_name}/{config_name}"]["load"]["mismatched"], [])


class Convert(unittest.TestCase):
    # families whose checkpoints differ between the layouts (a processor swap alone leaves every key as it is)
    @parameterized.expand([c for c in TP_CASES if any(r.in_checkpoints for r in W.families()[c[0]].rewrites)],
                          name_func=_name, skip_on_empty=True)  # empty under SURGERY_FAMILIES
    def test_round_trip_through_the_unfused_layout_is_bitwise(self, family_name, config_name):
        source = Path(fused_checkpoint(family_name, config_name))
        family = surgery.extend.families()[family_name]
        with tempfile.TemporaryDirectory() as tmp:
            surgery.state_dict.convert_checkpoint(source, f"{tmp}/unfused")
            surgery.state_dict.convert_checkpoint(f"{tmp}/unfused", f"{tmp}/fused", to="fused")
            original = {}
            for file in source.glob("*.safetensors"):
                original.update(load_file(file))
            back = {}
            for file in Path(f"{tmp}/fused").glob("*.safetensors"):
                back.update(load_file(file))
            self.assertEqual(sorted(back), sorted(original))
            for key, value in original.items():
                self.assertTrue(torch.equal(back[key], value), key)
            reloaded = model_class(family).from_pretrained(f"{tmp}/fused")
            self.assertEqual(sorted(reloaded.state_dict()), sorted(original))

