"""`surgery.save_pretrained` of a quantized model (torchao `quantize_`, GGUF or fp8 read per rank by
`load_tensor_parallel`) is refused before anything is written, naming the weight and its quantization (issue 41: the
write failed inside with "data pointer on an invalid python storage", "GGUFWeight ... aten.is_pinned" or a bare
NotImplementedError)."""

import copy
import tempfile
import unittest
from pathlib import Path

from torch.distributed.device_mesh import init_device_mesh

import surgery
from surgery.testing import single_rank_group
from surgery_rewrites.flux2 import seeded_model
from gguf_testing import GGUF_CONFIG, write_fp8, write_gguf


class QuantizedSave(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = seeded_model(GGUF_CONFIG, 0)

    def assert_refused(self, model, pattern: str, sharded: bool = False):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "out"
            folder.mkdir()
            (folder / "README.md").write_text("mine")
            with self.assertRaisesRegex(surgery.SurgeryError, pattern):
                if sharded:
                    with single_rank_group():
                        surgery.save_pretrained(model(), folder)
                else:
                    surgery.save_pretrained(model(), folder)
            self.assertEqual(sorted(p.name for p in Path(tmp).iterdir()), ["out"])  # no temporary sibling left
            self.assertEqual([p.name for p in folder.iterdir()], ["README.md"])

    def test_torchao(self):
        from torchao.quantization import Float8WeightOnlyConfig, quantize_

        model = surgery.unfuse(copy.deepcopy(self.model))
        quantize_(model, Float8WeightOnlyConfig())
        self.assert_refused(lambda: model, r"save_pretrained: 'time_guidance_embed.timestep_embedder.linear_1.weight' "
                                           r"of 'time_guidance_embed.timestep_embedder.linear_1' is quantized \(a torchao Float8Tensor\).*"
                                           r"Save the model before quantizing")

    def loaded(self, write, name):
        tmp = tempfile.mkdtemp()
        path = write(self.model, Path(tmp) / name)
        return lambda: surgery.load_tensor_parallel(None, path, init_device_mesh("cpu", (1,)), progress=False)

    def test_gguf_read_per_rank(self):
        self.assert_refused(self.loaded(lambda m, p: write_gguf(m, p, "Q8_0"), "model.gguf"),
                            r"'time_guidance_embed.timestep_embedder.linear_1.weight' of .* is quantized \(GGUF Q8_0 bytes\)", sharded=True)

    def test_fp8_read_per_rank(self):
        self.assert_refused(self.loaded(write_fp8, "model.safetensors"),
                            r"'time_guidance_embed.timestep_embedder.linear_1.weight' of .* is quantized \(a torchao Float8Tensor\)",
                            sharded=True)


if __name__ == "__main__":
    unittest.main()
