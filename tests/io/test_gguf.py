"""GGUF checkpoints (diffusers' GGUF loader) unfused and sharded: 2 gloo ranks against the same GGUF model run whole by
diffusers; cuts inside a GGUF block refused with the numbers."""

import functools
import os
import tempfile
import unittest
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from parameterized import parameterized

import surgery
from surgery.core.errors import SurgeryError
from surgery.core.prequantized import GGUFWeight
from surgery.io.loading import _load_single_file
from surgery.parallel.distributed import fake_process_group
from surgery.parallel.plans import checked_plan
from surgery.testing import FP32_TOL, run_on_cpu_ranks
from surgery_rewrites.flux2 import example_inputs, seeded_model
from gguf_testing import GGUF_CONFIG, load_gguf, write_fp8, write_gguf
import gguf_worker

WORLD = 2


@functools.lru_cache(maxsize=None)
def folder() -> str:
    root = Path(tempfile.mkdtemp(prefix="surgery-gguf-"))
    model = seeded_model(GGUF_CONFIG, 0)
    for kind in ("F32", *gguf_worker.KINDS):
        (root / kind).mkdir()
        write_gguf(model, root / kind / "model.gguf", kind)
    (root / "fp8").mkdir()
    write_fp8(model, root / "fp8" / "model.safetensors")
    return str(root)


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return run_on_cpu_ranks(gguf_worker.run, WORLD, folder())


def _stored(model) -> dict:
    return {name: (id(p), type(p), (p.qdata if isinstance(p, GGUFWeight) else p).detach().clone())
            for name, p in model.named_parameters()}


def _assert_same(test, model, before) -> None:
    now = _stored(model)
    test.assertEqual(list(now), list(before))
    for name, (ident, cls, value) in before.items():
        test.assertEqual((now[name][0], now[name][1]), (ident, cls), name)
        test.assertTrue(torch.equal(now[name][2], value), name)


class ShardedGGUF(unittest.TestCase):
    @parameterized.expand([(k,) for k in gguf_worker.KINDS])
    def test_the_reference_is_quantized(self, kind):
        # diffusers' GGUF model differs from the float one by quantization error, far above float noise: agreeing
        # with it says the sharded model runs the GGUF bytes
        for result in results():
            self.assertGreater(result[kind]["whole_vs_float"], 100 * FP32_TOL)

    @parameterized.expand([(k,) for k in gguf_worker.KINDS])
    def test_unfused_equals_whole_gguf_model(self, kind):
        for result in results():
            self.assertLessEqual(result[kind]["unfused"], FP32_TOL)

    @parameterized.expand([(k,) for k in gguf_worker.KINDS])
    def test_sharded_equals_whole_gguf_model(self, kind):
        for rank, result in enumerate(results()):
            self.assertLessEqual(result[kind]["tp"], FP32_TOL, f"rank {rank}")

    @parameterized.expand([(k,) for k in gguf_worker.KINDS])
    def test_each_rank_holds_its_cut_of_the_gguf_bytes(self, kind):
        for result in results():
            row = result[kind]
            self.assertEqual(row["tp_sharded_gguf"], 21)  # every block Linear of one double and one single block
            self.assertGreater(row["gguf_weights"], 21)  # and quantized Linears outside the blocks, whole
            self.assertEqual(row["tp_bytes"], row["tp_expected_bytes"])
            self.assertLess(row["tp_bytes"], row["whole_bytes"])


class LoadedSharded(unittest.TestCase):
    """`load_tensor_parallel` of the .gguf file: each rank reads only its bytes."""

    @parameterized.expand([(k,) for k in gguf_worker.KINDS])
    def test_equals_whole_gguf_model(self, kind):
        for rank, result in enumerate(results()):
            self.assertLessEqual(result[kind]["loaded"], FP32_TOL, f"rank {rank}")

    @parameterized.expand([(k,) for k in gguf_worker.KINDS])
    def test_holds_what_sharding_the_whole_model_holds(self, kind):
        for result in results():
            self.assertTrue(result[kind]["loaded_same_as_tp"])
            self.assertEqual(result[kind]["loaded_bytes"], result[kind]["tp_expected_bytes"])

    @parameterized.expand([(k,) for k in gguf_worker.KINDS])
    def test_bytes_read_equal_bytes_held(self, kind):
        # every tensor of the file is F32 or GGUF bytes, loaded as float32 / kept as bytes: a rank that read more
        # than its cut (a whole tensor, a row's other blocks) reads more than it holds
        for result in results():
            row = result[kind]
            self.assertEqual(row["loaded_read"], row["loaded_bytes"])
            self.assertLess(row["loaded_read"], row["file_bytes"])


class LoadedFp8WithScales(unittest.TestCase):
    """BFL's fp8r single file (float8 weights, per-row `weight_scale`) read per rank into torchao's Float8 layout,
    against diffusers' `BFLQuantizationConfig` model run whole."""

    def test_the_reference_is_quantized(self):
        for result in results():
            self.assertGreater(result["fp8"]["whole_vs_float"], 100 * FP32_TOL)

    def test_equals_whole_fp8_model(self):
        for rank, result in enumerate(results()):
            self.assertLessEqual(result["fp8"]["loaded"], FP32_TOL, f"rank {rank}")

    def test_diffusers_fp8_model_unfused_and_sharded_equals_it_whole(self):
        # the BFLFP8RLinears of diffusers' model become torchao Float8Tensors over the same values and scales
        for rank, result in enumerate(results()):
            self.assertLessEqual(result["fp8"]["unfused"], FP32_TOL, f"rank {rank}")
            self.assertLessEqual(result["fp8"]["tp"], FP32_TOL, f"rank {rank}")

    def test_loaded_holds_what_sharding_the_whole_model_holds(self):
        for result in results():
            self.assertTrue(result["fp8"]["loaded_same_as_tp"])
            self.assertEqual(result["fp8"]["loaded_bytes"], result["fp8"]["tp_bytes"])

    def test_each_rank_holds_its_cut_of_the_fp8_bytes(self):
        for result in results():
            row = result["fp8"]
            # every Linear is fp8; the 21 of the blocks are cut, the 11 others (modulation, embedders) stay whole
            self.assertEqual((row["float8_weights"], row["sharded_fp8"]), (32, 21))
            self.assertEqual(row["fp8_bytes"], row["expected_fp8_bytes"])
            self.assertLess(row["fp8_bytes"], row["whole_fp8_bytes"])

    def test_bytes_read_equal_bytes_held(self):
        for result in results():
            row = result["fp8"]
            self.assertEqual(row["loaded_read"], row["loaded_bytes"])
            self.assertLess(row["loaded_read"], row["file_bytes"])


class Planner(unittest.TestCase):
    def test_surgery_plan_quant_q4_predicts_the_bytes_each_rank_loads(self):
        # `surgery plan --quant q4` counts every Linear whose rows are whole 256-column blocks as Q4_K, the rest in
        # float32: the GGUF file written the same way, loaded per rank, holds exactly that
        for result in results():
            self.assertEqual(result["Q4_K"]["planned_bytes"], result["Q4_K"]["loaded_bytes"])


class CutsInsideABlock(unittest.TestCase):
    def test_unfuse_refuses_a_column_cut_inside_a_q4_k_block(self):
        # inner 320 + MLP hidden 960 = 1280 columns (5 Q4_K blocks) in the single block's to_out; the cut between
        # its attention and MLP parts falls at column 320, inside the second block
        config = dict(GGUF_CONFIG, num_attention_heads=5, attention_head_dim=64, axes_dims_rope=(16, 16, 16, 16))
        with tempfile.TemporaryDirectory() as tmp:
            path = write_gguf(seeded_model(config, 0), Path(tmp) / "model.gguf", "Q4_K", only=r"linear2")
            model = load_gguf(path)
        before = _stored(model)
        classes = [type(m) for m in model.modules()]
        with self.assertRaises(SurgeryError) as caught:
            surgery.unfuse(model)
        message = str(caught.exception)
        for part in ("single_transformer_blocks.0.attn.to_out.weight", "Q4_K", "blocks of 256", "column 320",
                     "of 1280"):
            self.assertIn(part, message)
        _assert_same(self, model, before)
        self.assertEqual([type(m) for m in model.modules()], classes)  # diffusers' GGUFLinears back in place

    def test_tensor_parallel_refuses_a_rowwise_cut_inside_a_q4_k_block(self):
        model = surgery.unfuse(load_gguf(Path(folder()) / "Q4_K" / "model.gguf"))
        with self.assertRaises(SurgeryError) as caught:
            checked_plan(model, None, None, 4)  # 512 columns in shards of 128, half a block
        message = str(caught.exception)
        for part in ("Q4_K", "blocks of 256", "512 columns into shards of 128", "mesh of 4"):
            self.assertIn(part, message)
        checked_plan(model, None, None, 2)

    def test_a_refused_tensor_parallel_puts_diffusers_gguf_linears_back(self):
        # tensor_parallel adopts diffusers' GGUFLinears (nn.Linears over the same bytes) before it plans; a refusal
        # (here: the model is still fused) gives the very same GGUFLinears and bytes back
        model = load_gguf(Path(folder()) / "Q4_K" / "model.gguf")
        before = _stored(model)
        classes = [type(m) for m in model.modules()]
        self.assertIn("GGUFLinear", {c.__name__ for c in classes})
        with fake_process_group(2):
            with self.assertRaises(SurgeryError) as caught:
                surgery.tensor_parallel(model, init_device_mesh("cpu", (2,)))
        self.assertIn("is still a fused", str(caught.exception))
        _assert_same(self, model, before)
        self.assertEqual([type(m) for m in model.modules()], classes)

    def test_loading_refuses_a_rowwise_cut_inside_a_q4_k_block_before_reading(self):
        class FourRanks:  # what the loader asks of a mesh before its first read or collective
            device_type = "cpu"

            def get_local_rank(self):
                return 0

            def size(self):
                return 4

        reads = []
        real = os.pread
        os.pread = lambda *a: reads.append(a) or real(*a)
        try:
            with self.assertRaises(SurgeryError) as caught:
                _load_single_file(None, Path(folder()) / "Q4_K" / "model.gguf", FourRanks(), dtype=None,
                                  progress=False, plan=None, filter_fn=None)
        finally:
            os.pread = real
        message = str(caught.exception)
        for part in ("transformer_blocks.0.attn.to_out.0.weight", "Q4_K", "blocks of 256", "column 128"):
            self.assertIn(part, message)
        self.assertEqual(reads, [])


class FusedPerRowFloat8(unittest.TestCase):
    def test_unfuse_slices_a_per_row_float8_model_quantized_fused(self):
        from torchao.quantization import Float8WeightOnlyConfig, quantize_

        model = seeded_model(GGUF_CONFIG, 0)
        quantize_(model, Float8WeightOnlyConfig())
        kw = example_inputs(GGUF_CONFIG, batch=1, image_tokens=4, text_tokens=3)
        with torch.no_grad():
            expected = model(**kw, return_dict=False)[0]
        fused = model.single_transformer_blocks[0].attn.to_out.weight
        surgery.unfuse(model)
        mlp = model.single_transformer_blocks[0].attn.to_out.mlp_part.weight
        self.assertEqual(type(mlp).__name__, "Float8Tensor")
        self.assertTrue(torch.equal(mlp.qdata.view(torch.uint8), fused.qdata[:, 512:].view(torch.uint8)))
        self.assertTrue(torch.equal(mlp.scale, fused.scale))  # one scale per row: the column parts share it
        with torch.no_grad():
            self.assertLessEqual((model(**kw, return_dict=False)[0] - expected).abs().max() / expected.abs().max(),
                                 FP32_TOL)


class TestFiles(unittest.TestCase):
    def test_the_written_layout_is_what_diffusers_reads(self):
        # the F32 file (BFL's names, fused q/k/v, swapped shift/scale) loads through diffusers' own conversion into
        # the seeded model bitwise: the quantized files differ from it only by their quantized bytes
        model = seeded_model(GGUF_CONFIG, 0)
        loaded = load_gguf(Path(folder()) / "F32" / "model.gguf").state_dict()
        expected = model.state_dict()
        self.assertEqual(set(loaded), set(expected))
        for name, value in expected.items():
            self.assertTrue(torch.equal(loaded[name], value), name)


class UnfusedGGUFForward(unittest.TestCase):
    def test_unfused_parts_hold_byte_slices_of_the_fused_weight(self):
        # rows of GGUF bytes are rows of the weight: q is the first 512 byte rows of to_qkv_mlp_proj, no copy
        model = load_gguf(Path(folder()) / "Q8_0" / "model.gguf")
        fused = model.single_transformer_blocks[0].attn.to_qkv_mlp_proj.weight
        surgery.unfuse(model)
        parts = model.single_transformer_blocks[0].attn.to_qkv_mlp_proj
        self.assertIsInstance(parts.q.weight, GGUFWeight)
        self.assertEqual(parts.q.weight.qdata.data_ptr(), fused.data_ptr())
        self.assertTrue(torch.equal(parts.k.weight.qdata, fused.as_tensor()[512:1024]))
        kw = example_inputs(GGUF_CONFIG, batch=1, image_tokens=4, text_tokens=3)
        self.assertEqual(model(**kw, return_dict=False)[0].shape, kw["hidden_states"].shape)

    def test_fuse_joins_the_bytes_back(self):
        model = load_gguf(Path(folder()) / "Q4_K" / "model.gguf")
        stored = {n: p.as_tensor().clone() for n, p in model.named_parameters() if hasattr(p, "as_tensor")}
        kw = example_inputs(GGUF_CONFIG, batch=1, image_tokens=4, text_tokens=3)
        with torch.no_grad():
            expected = model(**kw, return_dict=False)[0]
        surgery.fuse(surgery.unfuse(model))
        self.assertGreater(len(stored), 0)
        for name, data in stored.items():
            weight = model.get_parameter(name)
            self.assertIsInstance(weight, GGUFWeight, name)
            self.assertTrue(torch.equal(weight.qdata, data), name)
        with torch.no_grad():
            self.assertTrue(torch.equal(model(**kw, return_dict=False)[0], expected))


if __name__ == "__main__":
    unittest.main()
