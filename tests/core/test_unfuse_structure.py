"""What unfuse builds: zero-copy views, the report, processors, full-size configs on meta, idempotence."""

import copy
import unittest

import torch
import torch.nn as nn
from diffusers import Flux2Transformer2DModel
from diffusers.models.transformers.transformer_flux2 import (
    Flux2FeedForward,
    Flux2KVParallelSelfAttnProcessor,
    Flux2ParallelSelfAttention,
)
from parameterized import parameterized

import surgery
from surgery.testing import keep_attention_backend
from flux2_testing import build, small_config
from surgery_rewrites.flux2 import VARIANTS
from surgery.core.split_projection import SplitProjection, SplitRows

FUSED_NAMES = ("to_qkv_mlp_proj", "linear_in", "to_qkv", "to_added_qkv")


class ZeroCopy(unittest.TestCase):
    def test_row_slices_are_views_of_the_fused_storage(self):
        model = build(small_config("odd_heads"))
        fused = {name: p for name, p in model.named_parameters()}
        slices = surgery.state_dict.weight_slices(model)
        surgery.unfuse(model)
        unfused = dict(model.named_parameters())
        rows = [s for s in slices if s.dim == 0]
        self.assertEqual(len(rows), 2 * 2 * 2 + 2 * 5)  # 2 blocks x (ff, ff_context) x (gate, up) + 2 x 5 rows
        for s in rows:
            source, view = fused[s.fused], unfused[s.unfused]
            self.assertEqual(view.untyped_storage().data_ptr(), source.untyped_storage().data_ptr(), s.unfused)
            self.assertEqual(view.data_ptr(), source.data_ptr() + s.start * source.stride(0) * source.element_size())
            self.assertTrue(view.is_contiguous())

    def test_only_column_splits_copy(self):
        # rows stay views (one GEMM over the fused storage); columns are contiguous copies (FSDP2 refuses
        # non-contiguous parameters)
        config = small_config("klein4b_small")
        model = build(config)
        surgery.unfuse(model)
        records = surgery.core.rewrite.last_report(model)
        for record in records:
            if record.after.startswith("Flux2FeedForward"):
                self.assertEqual(record.bytes_copied, 0, record.path)
            else:
                to_out = model.get_submodule(record.path).to_out
                expected = (to_out.attn_part.weight.numel() + to_out.mlp_part.weight.numel()) * 4
                self.assertEqual(record.bytes_copied, expected, record.path)
                self.assertTrue(to_out.attn_part.weight.is_contiguous() and to_out.mlp_part.weight.is_contiguous())


class Report(unittest.TestCase):
    def test_paths_and_classes(self):
        model = build(small_config("klein9b_small"))
        surgery.unfuse(model)
        records = surgery.core.rewrite.last_report(model)
        self.assertEqual(
            [(r.path, r.before, r.after) for r in records],
            [("transformer_blocks.0.ff", "Flux2FeedForward[linear_in: Linear]", "Flux2FeedForward[linear_in: SplitRows]"),
             ("transformer_blocks.0.ff_context", "Flux2FeedForward[linear_in: Linear]",
              "Flux2FeedForward[linear_in: SplitRows]")]
            + [(f"single_transformer_blocks.{i}.attn", "Flux2ParallelSelfAttention[to_qkv_mlp_proj: Linear, to_out: Linear]",
                "Flux2ParallelSelfAttention[to_qkv_mlp_proj: SplitRows, to_out: SplitProjection]") for i in range(3)],
        )
        q = records[2].slices[0]
        self.assertEqual((q.fused, q.unfused, q.dim, q.start, q.stop),
                         ("single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight",
                          "single_transformer_blocks.0.attn.to_qkv_mlp_proj.q.weight", 0, 0, 64))


class Idempotence(unittest.TestCase):
    def test_second_unfuse_changes_nothing(self):
        model = build(small_config("dev_small"))
        surgery.unfuse(model)
        before = [(n, id(m)) for n, m in model.named_modules()]
        self.assertIs(surgery.unfuse(model), model)
        self.assertEqual([(n, id(m)) for n, m in model.named_modules()], before)

    def test_model_without_flux2_modules_is_returned_unchanged(self):
        model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        state = copy.deepcopy(model.state_dict())
        self.assertIs(surgery.unfuse(model), model)
        self.assertIs(surgery.fuse(model), model)
        for key, value in model.state_dict().items():
            self.assertTrue(torch.equal(value, state[key]))

    def test_a_block_a_wrapper_and_a_bare_module(self):
        model = build(small_config("klein4b_small"))
        block = surgery.unfuse(model.single_transformer_blocks[1])
        self.assertIsInstance(block.attn.to_qkv_mlp_proj, SplitRows)
        self.assertIsInstance(model.single_transformer_blocks[0].attn.to_qkv_mlp_proj, nn.Linear)
        holder = nn.ModuleDict({"transformer": model})
        surgery.unfuse(holder)
        self.assertFalse([n for n, m in holder.named_modules() if type(m) is nn.Linear
                          and n.endswith(("to_qkv_mlp_proj", "linear_in"))])
        bare = Flux2FeedForward(dim=8, mult=2.0)
        unfused = surgery.unfuse(bare)
        self.assertIs(type(unfused), Flux2FeedForward)
        self.assertIsInstance(unfused.linear_in, SplitRows)
        x = torch.randn(3, 8)
        torch.testing.assert_close(unfused(x), bare(x), rtol=0, atol=1e-6)


class KeepsWhatUsersRelyOn(unittest.TestCase):
    def test_dtype_device_requires_grad_and_mode(self):
        model = build(small_config("klein4b_small"), dtype=torch.bfloat16)
        model.single_transformer_blocks[0].attn.to_qkv_mlp_proj.requires_grad_(False)
        model.train()
        surgery.unfuse(model)
        attn = model.single_transformer_blocks[0].attn
        self.assertTrue(all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters()))
        rows = attn.to_qkv_mlp_proj
        self.assertFalse(any(lin.weight.requires_grad for lin in (rows.q, rows.v, rows.up)))
        self.assertTrue(attn.to_out.attn_part.weight.requires_grad)
        self.assertTrue(all(m.training for m in model.modules()))

    def test_stock_processors_stay_and_keep_their_backend(self):
        keep_attention_backend(self)
        model = build(small_config("klein4b_small"))
        model.set_attention_backend("native")
        processor = model.single_transformer_blocks[0].attn.processor
        surgery.unfuse(model)
        attn = model.single_transformer_blocks[0].attn
        self.assertIs(type(attn), Flux2ParallelSelfAttention)
        self.assertIs(attn.processor, processor)  # diffusers' own processor runs the leaves
        self.assertEqual(attn.processor._attention_backend.value, "native")
        model.set_attention_backend("_native_math")
        self.assertTrue(all(p._attention_backend.value == "_native_math" for p in model.attn_processors.values()))
        attn.set_processor(Flux2KVParallelSelfAttnProcessor())
        self.assertIs(type(attn.processor), Flux2KVParallelSelfAttnProcessor)
        surgery.fuse(model)
        self.assertIs(type(model.single_transformer_blocks[0].attn.processor), Flux2KVParallelSelfAttnProcessor)

    def test_global_sizes_stay_on_the_module(self):
        model = build(small_config("fractional_mlp"))
        stock = model.single_transformer_blocks[0].attn
        surgery.unfuse(model)
        attn = model.single_transformer_blocks[0].attn
        for attr in ("heads", "head_dim", "inner_dim", "out_dim", "mlp_hidden_dim", "mlp_ratio"):
            self.assertEqual(getattr(attn, attr), getattr(stock, attr), attr)
        self.assertEqual(attn.mlp_hidden_dim, 184)


class FullSizeOnMeta(unittest.TestCase):
    @parameterized.expand([(name,) for name in VARIANTS])
    def test_every_fused_linear_gone_and_parameter_count_unchanged(self, name):
        with torch.device("meta"):
            model = Flux2Transformer2DModel(**VARIANTS[name])
        stock = {n: p.shape for n, p in model.named_parameters()}
        surgery.unfuse(model)
        config = VARIANTS[name]
        self.assertEqual(len(surgery.core.rewrite.last_report(model)), 2 * config["num_layers"] + config["num_single_layers"])
        self.assertEqual(sum(p.numel() for p in model.parameters()), sum(s.numel() for s in stock.values()))
        self.assertFalse([n for n, m in model.named_modules() if type(m) is nn.Linear and n.endswith(FUSED_NAMES)])
        self.assertTrue(all(p.is_meta for p in model.parameters()))
        surgery.fuse(model)
        self.assertEqual({n: p.shape for n, p in model.named_parameters()}, stock)
