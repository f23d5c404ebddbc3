"""Bad input gets a clear error naming the module and leaves the model exactly as it was."""

import unittest
import warnings
from unittest import mock

import torch
import torch.nn as nn

import surgery
import surgery.core.rewrite
from surgery.testing import single_rank_group
from flux2_testing import assert_unchanged, build, small_config, snapshot

SINGLE = "single_transformer_blocks.1.attn"


class Refusals(unittest.TestCase):
    def setUp(self):
        self.model = build(small_config("klein4b_small"))

    def assert_refused(self, pattern, verb=surgery.unfuse, model=None):
        model = model or self.model
        snap = snapshot(model)
        with self.assertRaisesRegex(surgery.SurgeryError, pattern):
            verb(model)
        assert_unchanged(model, snap)

    def test_peft_lora_layers(self):
        from peft import LoraConfig

        self.model.add_adapter(LoraConfig(r=2, target_modules=["to_qkv_mlp_proj"]))
        self.assert_refused(r"'single_transformer_blocks.0.attn.to_qkv_mlp_proj' is wrapped by a PEFT/LoRA adapter .*unload")

    def test_dynamically_quantized_linear(self):
        attn = self.model.single_transformer_blocks[1].attn
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            attn.to_qkv_mlp_proj = torch.ao.quantization.quantize_dynamic(
                nn.Sequential(attn.to_qkv_mlp_proj), {nn.Linear}, dtype=torch.qint8
            )[0]
        self.assert_refused(rf"'{SINGLE}.to_qkv_mlp_proj' is a .*quantized.*before quantizing")

    def test_quantized_model_flag(self):
        self.model.is_quantized = True
        self.assert_refused(r"is quantized")

    def test_int8_weight(self):
        linear = self.model.transformer_blocks[0].ff.linear_in
        linear.weight = nn.Parameter(torch.zeros_like(linear.weight, dtype=torch.int8), requires_grad=False)
        self.assert_refused(r"'transformer_blocks.0.ff.linear_in.weight' holds .* torch.int8, which looks quantized")

    def test_hooks_that_a_swap_would_lose(self):
        self.model.single_transformer_blocks[2].attn.to_qkv_mlp_proj.register_forward_hook(lambda *a: None)
        self.assert_refused(r"'single_transformer_blocks.2.attn.to_qkv_mlp_proj' .* has _forward_hooks")

    def test_layerwise_casting_hooks(self):
        self.model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
        self.assert_refused(r"diffusers hooks")

    def test_accelerate_offloading_hooks(self):
        # accelerate's hooks replace `forward` on the instance (no torch hook): a swapped Linear would drop them. The
        # hooks `dispatch_model` attaches for a device_map (weights stay where they are, so the model can be compared)
        from accelerate.hooks import attach_align_device_hook

        attach_align_device_hook(self.model, execution_device=torch.device("cpu"))
        self.assert_refused(r"^surgery.unfuse: '[\w.]+' \(Linear\) has accelerate hooks \(device_map or CPU "
                            r"offloading\), which surgery.unfuse cannot carry over. Remove them")

    def test_attributes_that_no_longer_describe_the_weights(self):
        self.model.single_transformer_blocks[1].attn.mlp_hidden_dim += 8
        self.assert_refused(rf"'{SINGLE}.to_qkv_mlp_proj.weight' has shape \(432, 48\), but .* give 448 along dim 0")

    def test_custom_processor_is_kept_and_runs_on_the_leaves(self):
        class MyProcessor:  # written for the stock module: calls its fused Linears
            def __call__(self, attn, hidden_states, *args, **kw):
                return attn.to_out(attn.to_qkv_mlp_proj(hidden_states)[..., : attn.to_out.in_features])

        attn = self.model.single_transformer_blocks[0].attn
        attn.set_processor(processor := MyProcessor())
        x = torch.randn(2, 5, attn.query_dim)
        with torch.no_grad():
            expected = attn(x)
            surgery.unfuse(self.model)
            attn = self.model.single_transformer_blocks[0].attn
            self.assertIs(attn.processor, processor)
            torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-6)

    def test_fuse_parts_that_disagree(self):
        surgery.unfuse(self.model)
        self.model.single_transformer_blocks[1].attn.to_qkv_mlp_proj.k.requires_grad_(False)
        self.assert_refused(rf"the parts of '{SINGLE}.to_qkv_mlp_proj.weight' differ in requires_grad", surgery.fuse)

    def test_fuse_a_resized_part(self):
        surgery.unfuse(self.model)
        self.model.transformer_blocks[0].ff.linear_in.up = nn.Linear(48, 100, bias=False)
        self.assert_refused(r"'transformer_blocks.0.ff.linear_in.up.weight' has shape \(100, 48\)", surgery.fuse)

    def test_failure_midway_rolls_back(self):
        convert, calls = surgery.core.rewrite._convert, []

        def failing(module, rewrite, unfusing, *rest):
            calls.append(unfusing)
            if unfusing and len(calls) == 4:
                raise MemoryError("simulated")
            return convert(module, rewrite, unfusing, *rest)

        snap = snapshot(self.model)
        state = {k: v.clone() for k, v in self.model.state_dict().items()}
        with mock.patch.object(surgery.core.rewrite, "_convert", failing), self.assertRaises(MemoryError):
            surgery.unfuse(self.model)
        self.assertEqual(calls, [True] * 4)  # the old modules themselves go back, nothing is converted back
        self.assertEqual([type(m) for _, m in self.model.named_modules()], [t for _, _, t in snap[0]])
        for key, value in self.model.state_dict().items():
            self.assertTrue(torch.equal(value, state[key]), key)


class AlreadySharded(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.group = single_rank_group()
        cls.group.__enter__()

    @classmethod
    def tearDownClass(cls):
        cls.group.__exit__(None, None, None)

    def test_dtensor_weights(self):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        model = build(small_config("klein4b_small"))
        mesh = init_device_mesh("cpu", (1,))
        linear = model.single_transformer_blocks[3].attn.to_qkv_mlp_proj
        linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(0)]))
        snap = snapshot(model)
        with self.assertRaisesRegex(
            surgery.SurgeryError,
            r"'single_transformer_blocks.3.attn.to_qkv_mlp_proj.weight' is already sharded .*Shard\(dim=0\)",
        ):
            surgery.unfuse(model)
        assert_unchanged(model, snap)


    def test_accelerate_offloading_hooks_under_tensor_parallel(self):
        from accelerate.hooks import attach_align_device_hook
        from torch.distributed.device_mesh import init_device_mesh

        model = surgery.unfuse(build(small_config("klein4b_small")))
        attach_align_device_hook(model, execution_device=torch.device("cpu"))
        snap = snapshot(model)
        with self.assertRaisesRegex(surgery.SurgeryError, r"^surgery.tensor_parallel: .* has accelerate hooks "
                                                          r"\(device_map or CPU offloading\)"):
            surgery.tensor_parallel(model, init_device_mesh("cpu", (1,)))
        assert_unchanged(model, snap)


class InputErrorsAreOneClearLine(unittest.TestCase):
    """Issue 18's input errors: a `SurgeryError` (the CLI prints it as one line) naming the fix, never torch's or
    diffusers' bare message."""

    def test_context_parallel_inputs(self):
        import cp_input_worker
        from surgery.testing import run_on_cpu_ranks

        for rank, out in enumerate(run_on_cpu_ranks(cp_input_worker.run, 2)):
            self.assertRegex(out["unnamed"], r"^SurgeryError: surgery.context_parallel: ranks 0, 1: the mesh has no "
                                             r"dimension name; "
                                             r"build it with one, e.g. init_device_mesh\('cpu', \(2,\), "
                                             r"mesh_dim_names=\('cp',\)\)", f"rank {rank}")
            self.assertRegex(out["odd_tokens"], r"^SurgeryError: surgery.context_parallel: 'hidden_states' has 7 tokens "
                                                r"along dim 1, which the 2 context-parallel ranks cannot split evenly. "
                                                r"Use a sequence length divisible by 2 \(e.g. 8", f"rank {rank}")
            self.assertLessEqual(out["even_tokens"], 1e-5)  # the check refuses nothing that works

    def test_save_into_the_working_folder(self):
        import os
        import tempfile
        from pathlib import Path

        model = surgery.unfuse(build(small_config("klein4b_small")))
        cwd = os.getcwd()
        with tempfile.TemporaryDirectory() as tmp:
            try:
                os.chdir(tmp)
                self.assertEqual(surgery.save_pretrained(model, "."), Path(tmp).resolve())
                self.assertTrue(Path("config.json").is_file())
            finally:
                os.chdir(cwd)

    def test_config_class_that_is_no_model(self):
        import contextlib
        import io
        import json
        import tempfile
        from pathlib import Path

        from surgery.app.cli import main

        for name, what in (("utils", "no diffusers model class"), ("DiffusionPipeline", "a pipeline class, not a model"),
                           (None, "no diffusers model class")):
            with tempfile.TemporaryDirectory() as tmp, self.subTest(name):
                (Path(tmp) / "src").mkdir()
                (Path(tmp) / "src" / "config.json").write_text(json.dumps({"_class_name": name}))
                with self.assertRaisesRegex(surgery.SurgeryError, rf"names _class_name {name!r}, which is {what}\. "
                                                                  "Pass a diffusers model folder"):
                    surgery.state_dict.convert_checkpoint(Path(tmp) / "src", Path(tmp) / "out")
                stderr = io.StringIO()
                with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit):
                    main(["convert", str(Path(tmp) / "src"), str(Path(tmp) / "out")])
                self.assertEqual(len(stderr.getvalue().strip().splitlines()), 1, stderr.getvalue())
                self.assertNotIn("Traceback", stderr.getvalue())

    def test_explore_port_out_of_range(self):
        import contextlib
        import io

        from surgery.app.cli import main

        for port in ("70000", "0"):
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit) as exit_:
                main(["explore", "--port", port, "--no-serve"])
            self.assertEqual(exit_.exception.code, 2)
            self.assertRegex(stderr.getvalue(), rf"argument --port: a TCP port is 1 to 65535, got {port}\n$")
            self.assertNotIn("Traceback", stderr.getvalue())
