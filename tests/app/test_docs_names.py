"""Every `surgery.xxx.yyy` name the README and docs/ show exists (issue 41: docs/usage.md promised
`surgery.extend.register`, `register_tp_plan`, `registered` and `tp_plans`, none of which existed), and every name an
error message sends a user to is public (issue 38: 13 messages named private modules such as
`surgery.core.registry.register_tp_plan`)."""

import ast
import importlib
import re
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"(?<![\w.-])surgery(?:\.[A-Za-z_]\w*)+")
# a list in prose that names its first member in full and the rest by their last name: "`surgery.extend.Family`,
# `Rewrite` (or `register`), `families()`" stands for surgery.extend.Rewrite, .register, .families
LIST = re.compile(r"`(surgery(?:\.\w+)*)\.\w+(?:\(\))?`((?:(?:,\s*|\s*/\s*|\s+\(?or\s+)`\w+(?:\(\))?`)+)")
MEMBER = re.compile(r"`(\w+)(?:\(\))?`")


def documented_names() -> dict[str, str]:
    """Dotted name -> the first file that shows it."""
    names: dict[str, str] = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for name in NAME.findall(text):
            names.setdefault(name, path.name)
        for prefix, rest in LIST.findall(text):
            for member in MEMBER.findall(rest):
                names.setdefault(f"{prefix}.{member}", path.name)
    return names


def resolve(name: str) -> object:
    """The object a dotted name stands for: the longest importable module, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            value = getattr(value, attribute)
        return value
    raise ModuleNotFoundError(name)


# the three public modules, and the notebooks' inspection tools (docs/inspect.md)
PUBLIC_MODULES = ("lora", "state_dict", "extend", "sight")


def raised_names(root: Path) -> dict[str, str]:
    """Dotted `surgery.` names in the text of each `raise X(...)` under `root` -> the first place that shows one."""
    names: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            text = "".join(part.value for arg in node.exc.args for part in ast.walk(arg)
                           if isinstance(part, ast.Constant) and isinstance(part.value, str))
            for name in NAME.findall(text):
                names.setdefault(name, f"{path.relative_to(ROOT)}:{node.lineno}")
    return names


def public(name: str) -> bool:
    """A verb (`surgery.__all__`) or a member of a public module (its `__all__` where it has one)."""
    import surgery

    parts = name.split(".")
    if len(parts) == 2:
        return parts[1] in surgery.__all__ or parts[1] in PUBLIC_MODULES
    if parts[1] not in PUBLIC_MODULES:
        return False
    module = importlib.import_module(f"surgery.{parts[1]}")
    return parts[2] in getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")])


class ErrorMessages(unittest.TestCase):
    def test_every_name_an_error_gives_is_public(self):
        names = {**raised_names(ROOT / "surgery"), **raised_names(ROOT / "rewrites")}
        self.assertGreater(len(names), 10)  # the walk still finds the messages' names
        private = {name: where for name, where in names.items() if not public(name)}
        self.assertEqual(private, {})

    def test_a_private_name_is_found(self):
        self.assertFalse(public("surgery.core.registry.register_tp_plan"))
        self.assertFalse(public("surgery.extend.register_tp_plan"))
        self.assertTrue(public("surgery.extend.register_replicated"))
        self.assertTrue(public("surgery.lora.shard_lora"))


class DocumentedNames(unittest.TestCase):
    def test_every_dotted_name_resolves(self):
        names = documented_names()
        self.assertGreater(len(names), 30)  # the pattern still finds the docs' names
        missing = {}
        for name, where in names.items():
            try:
                resolve(name)
            except (ImportError, AttributeError) as error:
                missing[name] = f"{where}: {error}"
        self.assertEqual(missing, {})

    def test_a_name_that_does_not_exist_is_found(self):
        self.assertEqual(NAME.findall("`surgery.extend.register_tp_plan(cls, plan)` or surgery.fuse."),
                         ["surgery.extend.register_tp_plan", "surgery.fuse"])
        listed = LIST.findall("`surgery.extend.Family`, `Rewrite` (or `register` / `register_tp_plan()` for\n"
                              "pieces). Then `other`, and `surgery.fuse` returns `model`.")
        self.assertEqual([MEMBER.findall(rest) for _, rest in listed], [["Rewrite", "register", "register_tp_plan"]])
        self.assertEqual(listed[0][0], "surgery.extend")
        for name in ("surgery.extend.register_tp_plan", "surgery.nowhere.thing"):
            with self.assertRaises(AttributeError):
                resolve(name)


if __name__ == "__main__":
    unittest.main()
