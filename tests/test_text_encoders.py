"""Text encoders under tensor parallelism: every supported family's encoder class sharded with transformers' own plan
(or `rewrites/t5.py`'s), against the single-device encoder on 2 and 4 gloo ranks; one layer of the largest ones at
published width; the pipeline-level report and `surgery plan --pipeline`."""

import functools
import re
import tempfile
import unittest

import torch
from parameterized import parameterized

import surgery
import text_encoder_testing as E
import text_encoder_worker as W
from surgery.parallel.pipeline import pipeline_plan
from surgery.testing import run_on_cpu_ranks
from surgery.parallel.transformers_plans import STOCK_STYLES, stock_plan

FP32_TOL, BF16_TOL = 1e-5, 3e-2


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


class PublishedWidth(unittest.TestCase):
    def test_one_layer_at_published_width_bf16(self):
        for rank, result in enumerate(ranks(2)):
            for name in ("mistral3", "t5_xxl", "qwen25_vl_text"):
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
            expected = {"transformer", "text_encoder_2"} if kind == "flux1" else {"transformer", "text_encoder"}
            self.assertEqual(sharded, expected)

    def test_report_says_what_stays_whole_and_why(self):
        report = {r["component"]: r for r in ranks(2)[0]["pipelines"]["flux1"]["report"]}
        self.assertFalse(report["vae"]["sharded"])
        self.assertIn("no tensor-parallel plan", report["vae"]["reason"])
        self.assertIn("CLIPTextModel nor shipped by transformers", report["text_encoder"]["reason"])
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


class PipelinePlan(unittest.TestCase):
    def test_every_recorded_pipeline_is_planned_under_its_model_name(self):
        # a key that is no `--model` name (`bria-fibo-fibo`) made `plan --pipeline` refuse the family it records
        from surgery.core.registry import model_names

        names = set(model_names())
        for family in surgery.extend.families().values():
            for key in family.pipelines:
                with self.subTest(key=key):
                    self.assertIn(key, names)
                    rows = {r["component"] for r in pipeline_plan(key, 2)["components"]}
                    self.assertIn("transformer", rows)
                    self.assertTrue(set(family.pipelines[key]) - {"pipeline"} <= rows, rows)

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
        self.assertFalse(rows["text_encoder"]["sharded"])  # CLIP-L: no plan
        self.assertIn("no tensor-parallel plan", rows["text_encoder"]["reason"])


if __name__ == "__main__":
    unittest.main()
