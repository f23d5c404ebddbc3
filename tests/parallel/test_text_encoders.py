"""Text encoders under tensor parallelism: every supported family's encoder class sharded with transformers' own plan
(or `rewrites/t5.py`'s), against the single-device encoder on 2 and 4 gloo ranks; one layer of the largest ones at
published width; the pipeline-level report and `surgery plan --pipeline`."""

import functools
import re
import tempfile
import unittest

import pytest
import torch
from parameterized import parameterized

import surgery
import text_encoder_testing as E
import text_encoder_worker as W
from surgery.parallel.pipeline import pipeline_plan
from surgery.testing import run_on_cpu_ranks
from surgery.parallel.transformers_plans import STOCK_STYLES, stock_plan

from surgery.testing import BF16_TOL, FP32_GRAD_TOL, FP32_TOL


@functools.lru_cache(maxsize=None)
def ranks(world: int) -> list[dict]:
    if world != 2:
        return run_on_cpu_ranks(W.run, world)
    with tempfile.TemporaryDirectory(prefix="surgery-text-encoders-") as folder:
        W.save_text_encoders(folder)  # each as a pipeline's text_encoder/, sharded with an index
        return run_on_cpu_ranks(W.run, world, folder)


class TinyEncoders(unittest.TestCase):
    @parameterized.expand([(name, world) for world in (2, 4) for name in E.ENCODERS])
    def test_sharded_encoder_equals_single_device(self, name, world):
        for rank, result in enumerate(ranks(world)):
            row = result[name]
            print(f"\n{name} on {world} ranks, rank {rank}: rel err {row['error']:.2e} over {row['outputs']} outputs, "
                  f"{len(row['sharded'])} sharded tensors, {row['local_fraction']:.2f} of the weights held")
            self.assertLessEqual(row["error"], FP32_TOL)
            self.assertGreaterEqual(row["outputs"], 3)  # every hidden state (and the logits where computed)
            # the layers' projections are sharded: held weights fall well below the whole model
            self.assertTrue(any(re.search(r"(^|\.)(layers|block)\.1\.", n) for n in row["sharded"]), row["sharded"])
            self.assertLess(row["local_fraction"], 0.75 if world == 2 else 0.55)

    def test_plans_come_from_transformers_except_t5(self):
        for name, (build, _) in E.ENCODERS.items():
            encoder = build(0)
            from_transformers = stock_plan(encoder)
            self.assertEqual(bool(from_transformers), not name.startswith("t5"), name)

    def test_relative_attention_bias_is_sharded_with_the_heads(self):
        for result in ranks(2):
            self.assertIn("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                          result["t5"]["sharded"])

    def test_tied_embeddings_stay_whole(self):
        # Mistral3's default config ties lm_head to the input embedding: sharding one would untie them
        for result in ranks(2):
            sharded = result["mistral3"]["sharded"]
            self.assertFalse([n for n in sharded if "embed_tokens" in n or "lm_head" in n], sharded)
            self.assertIn("lm_head.weight", result["qwen3_causal"]["sharded"])  # untied: sharded

    def test_heads_the_mesh_cannot_split_are_refused(self):
        for result in ranks(4):
            self.assertRegex(result["refusal_mistral3_kv"], r"num_key_value_heads=1, which a mesh of 4 cannot split")
            self.assertRegex(result["refusal_t5_heads"], r"num_heads=3, which a mesh of 4 cannot split")

    def test_unknown_style_is_refused_by_name(self):
        encoder = E.llama(0)
        encoder._tp_plan = {**encoder._tp_plan, "layers.*.mlp.up_proj": "packed_colwise"}
        with self.assertRaisesRegex(surgery.SurgeryError, r"'layers.0.mlp.up_proj' with style 'packed_colwise'"):
            stock_plan(encoder)
        self.assertNotIn("packed_colwise", STOCK_STYLES)


@functools.lru_cache(maxsize=None)
def dit_ranks() -> list[dict]:
    return run_on_cpu_ranks(W.run_dit_encoders, 2)


def _expected_collectives(name: str) -> dict[str, int]:
    """What one forward should cost over 2 ranks, from each model's structure: one all-reduce per rowwise output
    (attention out and MLP out in each of the 2 layers), one for a vocabulary-parallel embedding (plain, untied); one
    all-gather where transformers' plan gathers a colwise output (GLM's fused gate_up in each layer, a causal LM's
    untied lm_head)."""
    layers = 2
    embedding = {"umt5": 0,  # tied to `shared`: whole
                 "clip": 0, "clip_projection": 0,  # no plan entry
                 "gemma2": 0, "gemma3": 0}.get(name, 1)  # Gemma scales its lookup in its own Embedding subclass: whole
    gathers = {"glm": layers, "qwen3_vl": 1, "llama_causal": 1}.get(name, 0)
    counts = {"all_reduce": 2 * layers + embedding}
    if gathers:
        counts["all_gather_into_tensor"] = gathers
    return counts


class DiTEncoders(unittest.TestCase):
    """The text encoders of the DiTs covered in the fourth round, each alone, one 2-rank job for all."""

    @parameterized.expand([(name,) for name in E.DIT_ENCODERS])
    def test_sharded_encoder_equals_single_device_forward_and_backward(self, name):
        for rank, result in enumerate(dit_ranks()):
            row = result[name]
            print(f"\n{name} ({E.DIT_ENCODERS[name][1]}), 2 ranks, rank {rank}: rel err {row['error']:.2e} over "
                  f"{row['outputs']} outputs, gradients {row['grad_error']:.2e}, {row['collectives']}, "
                  f"{row['local_fraction']:.2f} of the weights held")
            self.assertLessEqual(row["error"], FP32_TOL)
            self.assertLessEqual(row["grad_error"], FP32_GRAD_TOL)
            self.assertEqual(row["grads"], row["expected_grads"])
            self.assertGreaterEqual(row["outputs"], 3)
            self.assertTrue(any(re.search(r"(^|\.)(layers|block)\.1\.", n) for n in row["sharded"]), row["sharded"])
            self.assertLess(row["local_fraction"], 0.7)

    @parameterized.expand([(name,) for name in E.DIT_ENCODERS])
    def test_collectives_per_forward(self, name):
        for result in dit_ranks():
            self.assertEqual(result[name]["collectives"], _expected_collectives(name))

    def test_umt5_attention_runs_its_head_dim_twin_and_fuses_back(self):
        encoder = E.umt5(0)
        tokens, mask = E.ids()
        expected = E.outputs(encoder, tokens, mask)
        names = sorted(encoder.state_dict())
        surgery.unfuse(encoder)
        classes = {type(m).__name__ for m in encoder.modules()}
        self.assertIn("HeadDimUMT5Attention", classes)
        self.assertNotIn("UMT5Attention", classes)
        for got, want in zip(E.outputs(encoder, tokens, mask), expected):
            self.assertTrue(torch.equal(got, want))
        surgery.fuse(encoder)
        self.assertIn("UMT5Attention", {type(m).__name__ for m in encoder.modules()})
        self.assertEqual(sorted(encoder.state_dict()), names)
        for result in dit_ranks():  # sharded, the twin runs each rank's heads and their relative attention bias
            self.assertIn("HeadDimUMT5Attention", result["umt5"]["classes"])
            self.assertIn("encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight",
                          result["umt5"]["sharded"])

    def test_unfuse_keeps_a_transformers_models_own_plan(self):
        # diffusers' `_tp_plan` bookkeeping once popped the plan transformers' post_init merges from the configs
        for build in (E.gemma3, E.umt5, E.llama_causal):
            encoder = build(0)
            plan, blocks = dict(encoder._tp_plan), set(encoder._no_split_modules)
            surgery.unfuse(encoder)
            self.assertEqual((encoder._tp_plan, set(encoder._no_split_modules)), (plan, blocks))

    def test_heads_the_mesh_cannot_split_are_refused(self):
        for result in dit_ranks():
            self.assertRegex(result["refusal_umt5_heads"], r"'encoder.block.0.layer.0.SelfAttention' has num_heads=3")
            self.assertRegex(result["refusal_clip_heads"], r"'encoder.layers.0.self_attn' has num_attention_heads=3")
            self.assertRegex(result["refusal_glm_kv_heads"], r"'layers.0.self_attn' has num_key_value_heads=1")


class PublishedWidth(unittest.TestCase):
    def test_one_layer_at_published_width_bf16(self):
        for rank, result in enumerate(ranks(2)):
            for name in ("mistral3", "t5_xxl", "umt5_xxl", "qwen25_vl_text"):
                row = result["published"][name]
                print(f"\n{name}, one layer at published width, bf16, rank {rank}: rel err {row['error']:.2e}")
                self.assertLessEqual(row["error"], BF16_TOL, name)
                self.assertGreater(row["largest"], 2**24, name)
                self.assertGreaterEqual(row["sharded"], 7, name)


class WholePipelines(unittest.TestCase):
    @parameterized.expand([("flux2_dev",), ("flux1",), ("qwenimage",)])
    def test_sharded_pipeline_gives_the_single_device_image(self, kind):
        for rank, result in enumerate(ranks(2)):
            row = result["pipelines"][kind]
            print(f"\n{kind} pipeline, transformer and text encoders over 2 ranks, rank {rank}: rel err "
                  f"{row['error']:.2e}, PSNR {row['psnr']:.1f} dB")
            self.assertGreater(row["std"], 0.01)  # a real image, not a constant
            self.assertLessEqual(row["error"], FP32_TOL)
            sharded = {r["component"] for r in row["report"] if r["sharded"]}
            expected = {"transformer", "text_encoder"} | ({"text_encoder_2"} if kind == "flux1" else set())
            self.assertEqual(sharded, expected)

    def test_report_says_what_stays_whole_and_why(self):
        report = {r["component"]: r for r in ranks(2)[0]["pipelines"]["flux1"]["report"]}
        self.assertFalse(report["vae"]["sharded"])
        # the VAE's weights stay whole on every rank; its decode is split (surgery.decode_parallel)
        self.assertIn("weights whole; its decode split over 2 ranks by tiles", report["vae"]["reason"])
        self.assertTrue(report["text_encoder"]["sharded"])  # CLIP: the literal plan of rewrites/clip.py
        self.assertIn("not a torch module", report["tokenizer_2"]["reason"])


class Loading(unittest.TestCase):
    @parameterized.expand([(name,) for name in W.LOADED])
    def test_each_rank_reads_its_slices_of_text_encoder_safetensors(self, name):
        for rank, result in enumerate(ranks(2)):
            row = result["loading"][name]
            print(f"\n{name} loaded sharded from text_encoder/ ({row['files'] - 3} safetensors files), rank {rank}: "
                  f"rel err {row['error']:.2e}")
            self.assertLessEqual(row["error"], FP32_TOL)
            self.assertTrue(row["same_names"])
            self.assertTrue(row["bitwise"])  # the very shards tensor_parallel cuts from the loaded model
            self.assertGreater(row["shards"], 10)
            self.assertGreater(row["files"] - 3, 1)  # config, generation config, index + several shards


def recorded_pipelines() -> list:
    """`(family, key)` for every pipeline a family records."""
    from surgery.core.registry import families

    return [(family, key) for family in families().values() for key in family.pipelines]


def planned_models(key: str) -> list[str]:
    """The `--model` names `plan --pipeline` plans for a recorded key: the key itself, or for a diffusers transformer
    class, the default variant of each family holding it."""
    import diffusers

    from surgery.core.registry import families, model_names

    if key in model_names():
        return [key]
    if not hasattr(diffusers, key):
        return []
    return [f.name for f in families().values() if f.variants
            and (f.model_class if isinstance(f.model_class, str) else f.model_class.__name__).rpartition(".")[2] == key]


class PipelinePlan(unittest.TestCase):
    # a key that is no `--model` name (`bria-fibo-fibo`) made `plan --pipeline` refuse the family it records
    def test_every_recorded_pipeline_names_a_model(self):
        for family, key in recorded_pipelines():
            with self.subTest(key=key):
                self.assertTrue(planned_models(key), f"{family.name}: pipeline {key!r} names no model")

    def test_a_model_name_and_a_transformer_class_are_planned(self):
        self.check_planned([(f, k) for f, k in recorded_pipelines() if k in ("flux2-klein-4b", "WanTransformer3DModel")])

    @pytest.mark.heavy  # every pipeline's encoders and transformer built on meta (~1.5 min): CI's second run
    def test_every_recorded_pipeline_is_planned_under_its_model_name(self):
        self.check_planned(recorded_pipelines())

    def check_planned(self, pipelines):
        self.assertTrue(pipelines)
        for family, key in pipelines:
            for name in planned_models(key):
                with self.subTest(key=key, model=name):
                    rows = {r["component"] for r in pipeline_plan(name, 2)["components"]}
                    self.assertIn("transformer", rows)
                    self.assertTrue(set(family.pipelines[key]) - {"pipeline"} <= rows, rows)

    def test_a_family_finds_its_pipeline_by_its_transformer_class(self):
        # the DiT families arrive separately: any family holding WanTransformer3DModel gets Wan's components
        from unittest import mock

        from surgery.core import registry
        from surgery.parallel.pipeline import pipeline_components
        from surgery_rewrites import pipelines as P

        wan = registry.Family(name="wan-probe", model_class="diffusers.WanTransformer3DModel",
                              variants={"t2v-14b": {}, "i2v-14b": {}})
        other = registry.Family(name="other-probe", model_class="diffusers.AllegroTransformer3DModel",
                                variants={"a": {}})
        with mock.patch.dict(registry._families, {"wan-probe": wan, "other-probe": other}):
            for name in ("wan-probe-t2v-14b", "wan-probe-i2v-14b"):
                components = pipeline_components(name)
                self.assertEqual(components["pipeline"], "WanPipeline")
                self.assertIs(components["text_encoder"], P.UMT5_XXL)
            with self.assertRaisesRegex(surgery.SurgeryError, "no pipeline components are recorded for 'other-probe-a'"):
                pipeline_components("other-probe-a")

    def test_the_dits_text_encoders_at_published_size_tp8(self):
        # each recorded by its transformer class, accounted alone (the transformer families come separately)
        from surgery.parallel.distributed import fake_process_group
        from surgery.parallel.pipeline import build_on_meta, shard_component
        from surgery_rewrites import pipelines as P
        from torch.distributed.device_mesh import init_device_mesh

        refused = {  # published configs whose heads 8 ranks cannot split: whole, with the reason
            "GEMMA2_2B": "num_key_value_heads=4", "T5GEMMA_2B": "num_key_value_heads=4",
            "GLM4_9B": "num_key_value_heads=2", "QWEN25_VL_7B_TEXT": "num_attention_heads=28",
            "QWEN25_VL_7B": "num_attention_heads=28", "CLIP_L_PROJECTION": "num_attention_heads=12",
            "CLIP_L": "num_attention_heads=12", "CLIP_G_PROJECTION": "num_attention_heads=20",
            "BYT5_SMALL": "num_heads=6", "T5_BASE": "num_heads=12", "UMT5_BASE": "num_heads=12",
            # its vocabulary (transformers' plan shards the embedding by rows) is 151669 = 7 x 47 x 461
            "QWEN3_EMBEDDING_06B": "'embed_tokens' has 151669 output features",
        }
        specs = {name: spec for name, spec in vars(P).items() if isinstance(spec, tuple) and len(spec) == 3
                 and any(spec is c for entry in P.BY_TRANSFORMER.values() for c in entry.values())}
        self.assertGreaterEqual(len(specs), 14)
        with fake_process_group(8):
            mesh = init_device_mesh("cpu", (8,))
            for name, spec in specs.items():
                with self.subTest(name=name):
                    model = build_on_meta(spec, torch.bfloat16)
                    whole = sum(p.numel() * 2 for n, p in model.named_parameters()
                                if not re.search(r"(q|k|v|o|wi_0|wi_1|wo|relative_attention_bias|[a-z_]+_proj|fc1|fc2)"
                                                 r"\.(weight|bias)$", n) or "vision" in n or "visual" in n
                                or n.startswith("lm_head"))
                    row = shard_component(name, model, mesh, src_data_rank=None)
                    print(f"\n{name} at TP 8: {row['bytes'] / 2**30:.2f} GiB, {row['bytes_per_rank'] / 2**30:.2f} "
                          f"GiB per rank{'' if row['sharded'] else ', whole: ' + row['reason']}")
                    if name in refused:
                        self.assertFalse(row["sharded"])
                        self.assertIn(f"{refused[name]}, which a mesh of 8 cannot split", row["reason"])
                        self.assertEqual(row["bytes_per_rank"], row["bytes"])
                        continue
                    self.assertTrue(row["sharded"], row["reason"])
                    # every layer projection split 8 ways; embeddings, norms, vision towers and heads whole (a
                    # vocabulary-parallel embedding or lm_head, where planned, only lowers the count)
                    self.assertLessEqual(row["bytes_per_rank"], whole + (row["bytes"] - whole) / 8)
                    self.assertGreater(row["bytes_per_rank"], (row["bytes"] - whole) / 8)

    def test_flux2_dev_at_tp8(self):
        result = pipeline_plan("flux2-dev", 8)
        rows = {r["component"]: r for r in result["components"]}
        self.assertEqual(set(rows), {"transformer", "text_encoder", "vae"})
        encoder = rows["text_encoder"]
        self.assertTrue(encoder["sharded"])
        self.assertAlmostEqual(encoder["bytes"] / 1e9, 48.0, delta=1.0)  # Mistral-Small-3.1 24B in bf16
        # every text-layer weight is split 8 ways; what stays whole is the vision tower and the norms
        self.assertLess(encoder["bytes_per_rank"], encoder["bytes"] / 8 + 1e9)
        self.assertFalse(rows["vae"]["sharded"])
        self.assertEqual(rows["vae"]["bytes_per_rank"], rows["vae"]["bytes"])
        self.assertEqual(result["bytes_per_rank"], sum(r["bytes_per_rank"] for r in rows.values()))

    def test_an_encoder_the_mesh_cannot_split_is_left_whole_with_the_reason(self):
        rows = {r["component"]: r for r in pipeline_plan("qwen-image", 8)["components"]}
        self.assertFalse(rows["text_encoder"]["sharded"])  # Qwen2.5-VL-7B: 28 heads, 4 KV heads
        self.assertIn("num_attention_heads=28, which a mesh of 8 cannot split", rows["text_encoder"]["reason"])
        self.assertEqual(rows["text_encoder"]["bytes_per_rank"], rows["text_encoder"]["bytes"])
        self.assertTrue(rows["transformer"]["sharded"])
        rows = {r["component"]: r for r in pipeline_plan("flux1-dev", 8)["components"]}
        self.assertTrue(rows["text_encoder_2"]["sharded"])  # T5-XXL, 64 heads
        self.assertFalse(rows["text_encoder"]["sharded"])  # CLIP-L: 12 heads
        self.assertIn("num_attention_heads=12, which a mesh of 8 cannot split", rows["text_encoder"]["reason"])


if __name__ == "__main__":
    unittest.main()
