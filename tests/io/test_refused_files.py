"""Single files that cannot load right are refused at load, naming the file and the tensor (issue 41): GGUF types
diffusers cannot dequantize (they loaded, then the first forward raised a bare `KeyError: 9`), safetensors headers
that are not what safetensors writes (a `KeyError: 'dtype'` or a `MemoryError` before)."""

import json
import struct
import tempfile
import unittest
from pathlib import Path

import numpy as np
import torch
from parameterized import parameterized
from torch.distributed.device_mesh import init_device_mesh

import surgery
from surgery.testing import single_rank_group
from surgery_rewrites.flux2 import seeded_model
from gguf_testing import GGUF_CONFIG, write_fp8, write_stored

WEIGHT = "double_blocks.0.img_attn.proj.weight"  # BFL's name of transformer_blocks.0.attn.to_out.0.weight


def write_gguf_with(path: Path, kind: str) -> Path:
    """A FLUX.2 GGUF file whose every tensor is F32 but `WEIGHT`, stored as GGML type `kind` (bytes of that type)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]

    def stored(name, array):
        if name != WEIGHT:
            return None
        rows, cols = array.shape
        data = np.random.default_rng(0).integers(0, 127, (rows, cols // block * block_bytes)).astype(np.uint8)
        return (data.view(np.int8) if kind == "I8" else data), qtype

    return write_stored(seeded_model(GGUF_CONFIG, 0), path, stored)


def load(path: Path):
    with single_rank_group():
        return surgery.load_tensor_parallel(None, path, init_device_mesh("cpu", (1,)), progress=False)


class GGUFTypesDiffusersCannotRead(unittest.TestCase):
    @parameterized.expand([("Q8_1", 9), ("I8", 24)])
    def test_refused_at_load_naming_the_file_tensor_and_type(self, kind, number):
        with tempfile.TemporaryDirectory() as tmp:
            path = write_gguf_with(Path(tmp) / "model.gguf", kind)
            with self.assertRaises(surgery.SurgeryError) as caught:
                load(path)
        message = str(caught.exception)
        for part in (str(path), repr(WEIGHT), f"GGUF {kind} (type {number})", "diffusers cannot dequantize",
                     "Q8_0", "Q4_K"):
            self.assertIn(part, message)

    def test_a_type_diffusers_reads_loads(self):
        with tempfile.TemporaryDirectory() as tmp:
            model = load(write_gguf_with(Path(tmp) / "model.gguf", "Q8_0"))
        self.assertEqual(type(model.transformer_blocks[0].attn.to_out[0].weight).__name__, "GGUFWeight")


def _fp8_file(folder: Path) -> Path:
    return write_fp8(seeded_model(GGUF_CONFIG, 0), folder / "model.safetensors")


def _rewrite_header(path: Path, edit) -> None:
    """`path` with its JSON header changed by `edit(header) -> bytes of the new header` (data left as it was)."""
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = edit(json.loads(raw[8:8 + size]))
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + size:])


def _drop(key):
    def edit(header):
        header[next(n for n in header if n != "__metadata__")].pop(key)
        return json.dumps(header).encode()
    return edit


class MalformedSafetensorsHeader(unittest.TestCase):
    @parameterized.expand([
        ("no_dtype", _drop("dtype"), "no 'dtype'"),
        ("no_shape", _drop("shape"), "no 'shape'"),
        ("no_offsets", _drop("data_offsets"), "no 'data_offsets'"),
        ("not_an_object", lambda h: b"[1, 2, 3]", "not a JSON object"),
        ("not_json", lambda h: b"{\"a\": ", "not a readable safetensors file"),
        ("entry_not_an_object", lambda h: json.dumps(dict(h, x=5)).encode(), "'x' is 5"),
        ("shape_not_integers", lambda h: json.dumps(
            {k: (dict(v, shape=["a"]) if k != "__metadata__" else v) for k, v in h.items()}).encode(), "shape ['a']"),
    ])
    def test_refused_naming_the_file(self, _, edit, part):
        with tempfile.TemporaryDirectory() as tmp:
            path = _fp8_file(Path(tmp))
            _rewrite_header(path, edit)
            with self.assertRaises(surgery.SurgeryError) as caught:
                load(path)
        self.assertIn(str(path), str(caught.exception))
        self.assertIn(part, str(caught.exception))

    @parameterized.expand([("past_the_file", 1 << 40), ("past_any_memory", (1 << 64) - 1)])
    def test_a_header_size_beyond_the_file_is_refused_without_reading_it(self, _, size):
        with tempfile.TemporaryDirectory() as tmp:
            path = _fp8_file(Path(tmp))
            raw = path.read_bytes()
            path.write_bytes(struct.pack("<Q", size) + raw[8:])
            with self.assertRaises(surgery.SurgeryError) as caught:
                load(path)
        message = str(caught.exception)
        self.assertIn(str(path), message)
        self.assertIn(f"header of {size} bytes", message)
        self.assertIn(f"file of {len(raw)} bytes", message)


if __name__ == "__main__":
    unittest.main()
