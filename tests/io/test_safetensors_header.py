"""A safetensors file whose header does not describe its data is refused before any tensor is read, naming the file
and the tensor, as stock safetensors refuses it (before: one fp8 tensor's `data_offsets` moved by 4 bytes loaded
per rank 0.22 off)."""

import json
import shutil
import tempfile
import unittest
from pathlib import Path

from safetensors import SafetensorError, safe_open
from torch.distributed.device_mesh import DeviceMesh

import surgery
from surgery.io.sliced_files import SafetensorsFile
from surgery.testing import single_rank_group
from flux2_testing import build, small_config
from gguf_testing import write_fp8

CONFIG = small_config("tp_wide")
MOVED = "double_blocks.0.img_attn.qkv.weight"  # an fp8 weight in the middle of the file


def edited(path: Path, edit, extra: bytes = b"") -> Path:
    """A copy of `path` with `edit(header)` applied to its JSON header (kept the same length) and `extra` bytes
    appended."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= size, "the edited header must fit where the old one was"
    out = path.with_name(f"edited-{len(list(path.parent.iterdir()))}.safetensors")
    out.write_bytes(data[:8] + text.ljust(size) + data[8 + size:] + extra)
    return out


def shift(name: str, begin: int, end: int):
    def edit(header):
        header[name]["data_offsets"] = [header[name]["data_offsets"][0] + begin, header[name]["data_offsets"][1] + end]
    return edit


class DamagedHeader(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = Path(tempfile.mkdtemp(prefix="surgery-header-"))
        cls.good = write_fp8(build(CONFIG), cls.root / "model.safetensors")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root, ignore_errors=True)

    def test_an_intact_file_opens(self):
        with SafetensorsFile(self.good) as file:
            self.assertIn(MOVED, file.tensors)

    def test_a_moved_or_resized_tensor_is_refused_naming_file_and_tensor(self):
        cases = {
            "moved by 4 bytes": (shift(MOVED, 4, 4), b"", rf"'{MOVED}' is stored at data bytes \d+\.\.\d+, but its "
                                 r"shape \[\d+, \d+\] of F8_E4M3 needs \d+ bytes starting at \d+"),
            "4 bytes shorter": (shift(MOVED, 0, -4), b"", rf"'{MOVED}' is stored at data bytes"),
            "bytes after the last tensor": (lambda header: None, b"\0" * 4,
                                            r"its header describes \d+ bytes of tensor data, but the file holds \d+"),
        }
        for case, (edit, extra, pattern) in cases.items():
            with self.subTest(case):
                path = edited(self.good, edit, extra)
                with self.assertRaises(SafetensorError):  # stock safetensors refuses it too
                    with safe_open(str(path), "pt") as f:
                        [f.get_tensor(k) for k in f.keys()]
                with single_rank_group(), self.assertRaisesRegex(surgery.SurgeryError, rf"'{path}': .*{pattern}"):
                    surgery.load_tensor_parallel(None, path, DeviceMesh("cpu", [0]), progress=False)
