"""Inside the real diffusers stack: Klein, Klein KV and FLUX.2-dev pipelines end to end, TP across gloo ranks, the Qwen3 text encoder, compile,
attention backends."""

import copy
import functools
import unittest

import PIL.Image
import pytest
import torch
from diffusers.models.attention_dispatch import AttentionBackendName

import pipeline_testing as P
import pipeline_worker
import surgery
from surgery.testing import keep_attention_backend, run_on_cpu_ranks
from flux2_testing import build, inputs, rel_err, small_config

from surgery.testing import FP32_TOL


@functools.lru_cache(maxsize=None)
def stock_image() -> torch.Tensor:
    return P.generate(P.klein_pipeline(0))


@functools.lru_cache(maxsize=None)
def two_ranks() -> list[dict]:
    return run_on_cpu_ranks(pipeline_worker.run, 2)


class KleinPipeline(unittest.TestCase):
    def test_unfused_transformer_gives_the_stock_image(self):
        pipe = P.klein_pipeline(0)
        surgery.unfuse(pipe.transformer)
        image = P.generate(pipe)
        print(f"\nKlein pipeline, unfused vs stock: rel err {rel_err(image, stock_image()):.2e}, "
              f"PSNR {P.psnr(image, stock_image()):.1f} dB")
        self.assertLessEqual(rel_err(image, stock_image()), FP32_TOL)

    def test_kv_pipeline_with_a_reference_image(self):
        reference = PIL.Image.fromarray((torch.rand(64, 64, 3, generator=torch.Generator().manual_seed(1)) * 255)
                                        .to(torch.uint8).numpy())
        images = []
        for unfuse in (False, True):
            pipe = P.klein_pipeline(0, kv=True)
            if unfuse:
                surgery.unfuse(pipe.transformer)
            images.append(P.generate(pipe, image=[reference]))
        self.assertLessEqual(rel_err(images[1], images[0]), FP32_TOL)
        self.assertGreater(rel_err(images[0], stock_image()), 1e-3)  # the reference image changed the result

    def test_tensor_parallel_over_two_ranks_gives_the_single_device_image(self):
        for rank, result in enumerate(two_ranks()):
            for key in ("image_transformer_tp", "image_both_tp"):
                error = rel_err(result[key], stock_image())
                print(f"\nrank {rank} {key}: rel err {error:.2e}, PSNR {P.psnr(result[key], stock_image()):.1f} dB")
                self.assertLessEqual(error, FP32_TOL, f"rank {rank} {key}")


class DevPipeline(unittest.TestCase):
    def test_unfused_transformer_gives_the_stock_image(self):
        images = []
        for unfuse in (False, True):
            pipe = P.dev_pipeline(0)
            if unfuse:
                surgery.unfuse(pipe.transformer)
            images.append(P.generate(pipe, max_sequence_length=64))  # the system message takes most of it
        print(f"\nFLUX.2-dev pipeline, unfused vs stock: rel err {rel_err(images[1], images[0]):.2e}, "
              f"PSNR {P.psnr(images[1], images[0]):.1f} dB")
        self.assertLessEqual(rel_err(images[1], images[0]), FP32_TOL)


class TextEncoder(unittest.TestCase):
    def test_qwen3_tensor_parallel_equals_single_device(self):
        for result in two_ranks():
            self.assertLessEqual(result["text_encoder"], FP32_TOL)
            self.assertEqual(result["text_encoder_sharded"],  # transformers' own plan: the vocabulary too
                             ["down_proj", "embed_tokens", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj",
                              "up_proj", "v_proj"])

    def test_kv_heads_the_mesh_cannot_split_are_refused(self):
        for result in two_ranks():
            self.assertRegex(result["kv_heads_refusal"], r"num_key_value_heads=1, which a mesh of 2 cannot split")


@pytest.mark.heavy  # inductor compiles for ~30 s a process; diffusers' regional compile (eager) is in the default tier
class Compile(unittest.TestCase):
    def test_unfused_model_compiles_and_matches_eager(self):
        config = dict(small_config("klein9b_small"), num_single_layers=1)
        model = surgery.unfuse(build(config, 0))
        kw = inputs(config, 0)
        with torch.no_grad():
            eager = model(**kw).sample
            compiled = torch.compile(model)(**kw).sample
        self.assertLessEqual(rel_err(compiled, eager), FP32_TOL)

    def test_tensor_parallel_model_compiles_and_matches(self):
        for result in run_on_cpu_ranks(pipeline_worker.run_compiled, 2):
            self.assertIsInstance(result["compiled_tp"], float, result["compiled_tp"])
            self.assertLessEqual(result["compiled_tp"], FP32_TOL)


# The backends the README lists as working on CPU ("Attention backends"); the others need a device or a package.
README_CPU_BACKENDS = ("native", "_native_math", "_native_flash", "flex")


class AttentionBackends(unittest.TestCase):
    def test_every_backend_available_here(self):
        keep_attention_backend(self)
        config = small_config("klein4b_small")
        fused = build(config, 2)
        unfused = surgery.unfuse(copy.deepcopy(fused))
        kw = inputs(config, 2)
        tested = []
        for backend in AttentionBackendName:
            try:
                fused.set_attention_backend(backend.value)
                with torch.no_grad():
                    expected = fused(**kw).sample
            except Exception:  # not available on this machine (a kernel, a device or a package is missing)
                continue
            unfused.set_attention_backend(backend.value)
            self.assertTrue(all(p._attention_backend == backend for p in unfused.attn_processors.values()))
            with torch.no_grad():
                self.assertLessEqual(rel_err(unfused(**kw).sample, expected), FP32_TOL, backend.value)
            tested.append(backend.value)
        print(f"\nattention backends tested: {tested}")
        for listed in README_CPU_BACKENDS:  # what the README says works after unfuse on CPU must have run here
            self.assertIn(listed, tested)
