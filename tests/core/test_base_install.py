"""The base install is enough for the README's main job: nothing imports an optional package at module level.

transformers, peft, torchao and gguf serve particular paths (text encoders, LoRA, quantized weights, GGUF files). A user
who runs only a transformer has none of them, so `import surgery`, every public module, the demo, `surgery plan`,
`unfuse`, `tensor_parallel`, `save_pretrained` and `load_tensor_parallel` must work without them. The test hides them
from a subprocess (and the CPU ranks it spawns) the way a missing install would: `importlib.util.find_spec` finds
nothing and `import` raises `ModuleNotFoundError`, so diffusers' own availability checks see them absent too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

HIDDEN = ("transformers", "peft", "torchao", "gguf")

# Installed as `sitecustomize` on PYTHONPATH, so every process of the job (the spawned ranks too) starts without them.
HIDE = textwrap.dedent(f"""
    import sys

    HIDDEN = {HIDDEN!r}

    class _Hiding:
        '''Wraps one finder of sys.meta_path: the hidden packages are not found, the rest as before.'''
        def __init__(self, finder):
            self.finder = finder

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in HIDDEN:
                return None
            find = getattr(self.finder, "find_spec", None)
            return find(name, path, target) if find else None

        def __getattr__(self, name):
            return getattr(self.finder, name)

    sys.meta_path[:] = [_Hiding(finder) for finder in sys.meta_path]
""")

JOB = textwrap.dedent("""
    import importlib, pkgutil, sys, tempfile
    import torch
    import surgery, surgery_rewrites
    from surgery.app.cli import main

    for package in (surgery, surgery_rewrites):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not info.name.endswith(".__main__"):  # `python -m surgery` runs the CLI on import
                importlib.import_module(info.name)
    print("imported every module")

    assert main(["demo", "--layers", "1", "--single-layers", "2", "--head-dim", "8"]) == 0
    assert main(["plan", "--model", "flux2-klein-4b", "--tp", "2"]) == 0
    try:  # the text encoders need transformers: one line and exit 1, as for any refusal
        main(["plan", "--model", "flux2-klein-4b", "--tp", "2", "--pipeline"])
    except SystemExit as exit:
        assert exit.code == 1, exit.code
    else:
        raise AssertionError("plan --pipeline ran without transformers")

    from surgery.testing import seeded_model
    from diffusers import Flux2Transformer2DModel
    from torch.distributed.device_mesh import init_device_mesh
    config = dict(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
                  num_attention_heads=2, joint_attention_dim=16, timestep_guidance_channels=16, mlp_ratio=3.0,
                  axes_dims_rope=(2, 2, 2, 2))
    model = surgery.unfuse(Flux2Transformer2DModel(**config))
    with tempfile.TemporaryDirectory() as folder:
        surgery.save_pretrained(model, folder)
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        loaded = surgery.load_tensor_parallel(Flux2Transformer2DModel, folder, mesh)
        surgery.tensor_parallel(surgery.unfuse(Flux2Transformer2DModel(**config)), mesh)
    assert set(loaded.state_dict()) == set(model.state_dict())
    print("verbs ran")
    assert not [name for name in sys.modules if name.partition(".")[0] in {hidden}], "an optional package was imported"
""")


def run_hidden(job: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as site:
        with open(os.path.join(site, "sitecustomize.py"), "w") as file:
            file.write(HIDE)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        return subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, env=env, timeout=900)


class BaseInstall(unittest.TestCase):
    def test_hiding_works(self):
        # the hook itself can fail: each hidden package is then not found, as on a machine without it
        result = run_hidden("import importlib.util, sys\n"
                            f"assert all(importlib.util.find_spec(n) is None for n in {HIDDEN!r})\n"
                            "from diffusers.utils import is_transformers_available, is_peft_available\n"
                            "assert not is_transformers_available() and not is_peft_available()\n"
                            "import transformers")
        self.assertIn("ModuleNotFoundError: No module named 'transformers'", result.stderr)

    def test_public_modules_and_main_job_without_optional_packages(self):
        result = run_hidden(JOB.replace("{hidden}", repr(set(HIDDEN))))
        self.assertEqual(result.returncode, 0, result.stdout[-3000:] + result.stderr[-3000:])
        self.assertIn("imported every module", result.stdout)
        self.assertIn("OK: worst error", result.stdout)
        # the pipeline's text encoders need transformers: one line saying so, no traceback
        self.assertIn("needs the optional package 'transformers'", result.stdout + result.stderr)
        self.assertNotIn("Traceback", result.stderr)
        self.assertIn("verbs ran", result.stdout)


if __name__ == "__main__":
    unittest.main()
