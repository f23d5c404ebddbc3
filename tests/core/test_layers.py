"""The engine's folders are its layers: every import (those inside functions too) points to the same layer or one
below it, no two modules import each other (directly or round a loop), and no module of surgery is imported lazily.

The graph is read from the source (the AST), not from `sys.modules`, so an import that only runs on some path
counts as much as one at the top of a file.
"""

from __future__ import annotations

import ast
import tempfile
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top. A module may import modules of its own layer and of the layers before it, never those after.
LAYERS = (
    ("core", ("surgery.core",)),
    ("parallel", ("surgery.parallel",)),
    ("io", ("surgery.io",)),
    ("integration", ("surgery.integration",)),
    ("extend", ("surgery.extend",)),  # what a family imports: the extension surface, one module
    ("families", ("surgery_rewrites",)),
    ("api", ("surgery", "surgery.lora", "surgery.state_dict")),  # the public verbs and modules
    ("testing", ("surgery.testing",)),
    ("sight", ("surgery.sight",)),
    ("app", ("surgery.app", "surgery.__main__")),
)
# The only packages imported inside functions, each for the reason given: what `pyproject.toml` leaves optional. Any
# other import sits at the top of its module, where a reader sees it; an import inside `try: ... except ImportError`
# (a private module that not every version has) says why beside it too.
LAZY_ALLOWED = {
    "peft": "LoRA; a user's own install or the [test] extra, not a dependency",
    "transformers": "text encoders only; not a dependency",
    "graphviz": "diagrams; without it they print as text tables",
    "model_explorer": "the [explore] extra",
    "IPython": "there only inside a notebook",
}

# The families are data written on the extension surface (`surgery.extend`) and on each other; the built-in ones are
# in-house and take what only they need (slices, checks, the derivation's norms) from the engine's core and parallel
# layers, never from io, integration or anything above them.
FAMILIES_MAY_IMPORT = {"core", "parallel", "extend", "families"}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "surgery").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    for path in sorted((ROOT / "rewrites").glob("*.py")):
        found["surgery_rewrites" + ("" if path.stem == "__init__" else f".{path.stem}")] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """`(imported module, line, inside a function or class)` for every import of a module in `known`."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            # `from package import submodule` is an import of the submodule, not of the package's __init__
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        for target in dict.fromkeys(targets):
            if target in known and target != name:
                found.append((target, node.lineno, id(node) not in top))
    return found


def layer_of(name: str) -> int:
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    if best is None:
        raise AssertionError(f"{name} belongs to no declared layer: add it to LAYERS in {__file__}")
    return best[0]


def graph() -> dict[str, list[tuple[str, int, bool]]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, list]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, _, _ in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


class Layers(unittest.TestCase):
    def test_every_module_has_a_layer(self):
        for name in modules():
            layer_of(name)

    def test_no_import_points_up(self):
        upward = []
        for name, edges in graph().items():
            for target, line, _ in edges:
                if layer_of(target) > layer_of(name):
                    upward.append(f"{name}:{line} imports {target} "
                                  f"({LAYERS[layer_of(name)][0]} -> {LAYERS[layer_of(target)][0]})")
        self.assertEqual(upward, [])

    def test_families_import_only_the_extension_surface(self):
        allowed = {i for i, (layer, _) in enumerate(LAYERS) if layer in FAMILIES_MAY_IMPORT}
        wrong = [f"{name}:{line} imports {target}" for name, edges in graph().items()
                 if name.startswith("surgery_rewrites") for target, line, _ in edges if layer_of(target) not in allowed]
        self.assertEqual(wrong, [])

    def test_the_extension_surface_is_what_families_use_or_the_docs_show(self):
        """`surgery.extend` stays small: each name it exports is imported from it by a built-in family or shown in
        docs/usage.md, and it exports nothing beyond its `__all__` (what `surgery.extend` offers is that list)."""
        import surgery.extend

        imported = {alias.name for path in (ROOT / "rewrites").glob("*.py")
                    for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ImportFrom) and node.module == "surgery.extend" for alias in node.names}
        usage = (ROOT / "docs" / "usage.md").read_text()
        self.assertEqual([n for n in surgery.extend.__all__ if n not in imported and f"surgery.extend.{n}" not in usage],
                         [])
        self.assertEqual(sorted(n for n in vars(surgery.extend) if not n.startswith("_")), sorted(surgery.extend.__all__))
        self.assertLessEqual(len(surgery.extend.__all__), 15)  # about a dozen names a family author needs

    def test_no_cycles_lazy_imports_included(self):
        self.assertEqual(cycles(graph()), [])

    def test_no_lazy_import_of_surgery(self):
        lazy = [f"{name}:{line} imports {target} inside a function" for name, edges in graph().items()
                for target, line, inside in edges if inside]
        self.assertEqual(lazy, [])

    def test_lazy_imports_only_of_optional_packages_each_with_its_reason(self):
        wrong = []
        for name, path in modules().items():
            source = path.read_text()
            tree = ast.parse(source)
            lines = source.splitlines()
            top = {id(node) for node in tree.body}
            guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.Try)
                       and any("ImportError" in ast.unparse(h.type or ast.Name("")) for h in node.handlers)
                       for n in ast.walk(node)}
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in top or getattr(node, "level", 0):
                    continue
                package = (node.module if isinstance(node, ast.ImportFrom) else node.names[0].name).split(".")[0]
                said = "#" in lines[node.end_lineno - 1] or "#" in lines[node.lineno - 2]
                if not said or (package not in LAZY_ALLOWED and id(node) not in guarded):
                    wrong.append(f"{name}:{node.lineno} imports {package} inside a function")
        self.assertEqual(wrong, [])

    def test_the_layout_page_names_every_engine_module(self):
        # docs/layout.md's first block: each folder of surgery/, then the modules it holds, by name
        import re

        block = (ROOT / "docs" / "layout.md").read_text().split("```")[1]
        described = {entry.split()[0]: entry for entry in re.split(r"\n(?=\S)", block.strip())}
        for folder in sorted(p for p in (ROOT / "surgery").iterdir() if (p / "__init__.py").exists()):
            text = described.get(f"surgery/{folder.name}/", "")
            for module in sorted(folder.glob("*.py")):
                if module.stem != "__init__":
                    self.assertRegex(text, rf"\b{module.stem}\b", f"docs/layout.md: surgery/{folder.name}/{module.name}")

    def test_the_checks_see_a_broken_graph(self):
        """The checks above must be able to fail: an upward edge, a loop and a lazy import, added on paper."""
        edges = graph()
        self.assertIn("surgery.core.slicing", [t for t, _, _ in edges["surgery.core.rewrite"]])
        edges["surgery.core.rewrite"] = edges["surgery.core.rewrite"] + [("surgery.integration.interop", 1, True)]
        edges["surgery.core.slicing"] = edges["surgery.core.slicing"] + [("surgery.core.rewrite", 1, True)]
        self.assertTrue(any(layer_of(t) > layer_of("surgery.core.rewrite") for t, _, _ in edges["surgery.core.rewrite"]))
        loops = sum(cycles(edges), [])
        self.assertIn("surgery.core.rewrite", loops)
        self.assertIn("surgery.core.slicing", loops)

    def test_imports_are_read_from_function_bodies_and_relative_forms(self):
        source = "from .slicing import Slice\n\ndef f():\n    from surgery.parallel import plans\n"
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "probe.py"
            path.write_text(source)
            found = imports("surgery.core.probe", path, {**modules(), "surgery.core.probe": path})
        self.assertIn(("surgery.core.slicing", 1, False), found)
        self.assertIn(("surgery.parallel.plans", 4, True), found)


class InstalledNames(unittest.TestCase):
    def test_the_families_install_as_surgery_rewrites(self):
        import surgery  # noqa: F401
        import surgery_rewrites

        self.assertEqual(Path(surgery_rewrites.__file__).parent, ROOT / "rewrites")
        text = (ROOT / "pyproject.toml").read_text()
        self.assertIn('"surgery_rewrites" = "rewrites"', text)
        self.assertNotIn('"rewrites*"', text)

    def test_the_console_script_points_at_the_cli(self):
        import importlib
        import re

        target = re.search(r'^surgery = "([\w.]+):(\w+)"', (ROOT / "pyproject.toml").read_text(), re.M)
        self.assertIsNotNone(target)
        self.assertTrue(callable(getattr(importlib.import_module(target.group(1)), target.group(2))))

    def test_importing_the_folder_by_its_old_name_is_refused(self):
        import subprocess
        import sys

        result = subprocess.run([sys.executable, "-c", "import rewrites"], cwd=ROOT, capture_output=True, text=True)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("surgery_rewrites", result.stderr)

    def test_one_name_per_thing_no_old_paths(self):
        """Nothing has shipped: no module aliases, no renamed fields, no short model names."""
        import subprocess
        import sys

        import surgery
        from surgery.extend import Family

        self.assertEqual(sorted(surgery.__all__), sorted([
            "unfuse", "fuse", "tensor_parallel", "load_tensor_parallel", "save_pretrained", "context_parallel",
            "tensor_parallel_pipeline", "decode_parallel", "SurgeryError"]))
        for old in ("key_map", "weight_slices", "register_family", "shard_lora", "inspect", "registry"):
            self.assertFalse(hasattr(surgery, old), old)
        with self.assertRaises(TypeError):
            Family(name="x", model_class=None, reduced=lambda c: c)
        # the flat fields before the model / tp / tests grouping
        for old in ("test_configs", "tp_plans", "tp_checks", "tp_when", "replicated", "rotary", "count_all_reduces",
                    "rounds_to"):
            with self.assertRaises(TypeError, msg=old):
                Family(name="x", model_class=None, **{old: None})
        self.assertFalse(hasattr(Family, "aliases"))
        result = subprocess.run([sys.executable, "-c", "import surgery.inspect"], cwd=ROOT, capture_output=True,
                                text=True)
        self.assertIn("No module named 'surgery.inspect'", result.stderr)


if __name__ == "__main__":
    unittest.main()
