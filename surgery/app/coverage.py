"""Which diffusers transformer classes `surgery.tensor_parallel` shards, and how that is proven.

`class_status` plans one class as the verb does: built on meta (its family's default published config, else the
class's defaults), unfused, planned for N ranks. The proof (`surgery/app/families.json`) is that plan step for every
class plus, for each registered family, the conformance suite's real gloo run at world 2 and 4; it is written by
`python tests/families/proof.py` (through `write_proof` here), never by hand, and
`docs/families.md`, the README's table, `surgery families` and notebook 04 all read it.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import diffusers
import diffusers.models.transformers as transformers
import torch
from diffusers import ModelMixin
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from surgery.core.build import build, model_on_meta
from surgery.core.errors import SurgeryError
from surgery.core.registry import families, model_class
from surgery.core.rewrite import unfuse
from surgery.core.walk import find_modules
from surgery.parallel.families import all_reduces
from surgery.parallel.plans import block_plans, checked_plan
from surgery_cli import proof_path, read_proof, summary, table

DOC = Path(__file__).resolve().parents[2] / "docs" / "families.md"
README = DOC.parent.parent / "README.md"
README_BEGIN = "<!-- families: generated with the proof (docs/families.md says how) -->"
README_END = "<!-- /families -->"


def transformer_classes() -> list[type]:
    """diffusers' transformer model classes (`diffusers.models.transformers`), by name."""
    found = {obj for _, obj in inspect.getmembers(transformers, inspect.isclass)
             if issubclass(obj, ModelMixin) and obj is not ModelMixin}
    return sorted(found, key=lambda c: c.__name__)


def class_status(cls: type, world: int = 2) -> dict:
    """`{"class", "family", "status", "all_reduces", "reason"}` for one class, from the plan step alone: sharded (a
    registered family's class; the conformance suite proves it, `write_proof` records that; all-reduces per forward
    read off the plan), planned, unproven (the plan step passes, but no family registers the class, so nothing has
    run it sharded), refused (the plan step's one-line reason) or not built (its default config fails)."""
    family = next((f for f in families().values() if f.variants and model_class(f) is cls), None)
    row = {"class": cls.__name__, "family": family.name if family else "", "all_reduces": None, "reason": ""}
    try:
        with torch.device("meta"):
            model = build(family, family.config()) if family else cls()
    except Exception as error:  # noqa: BLE001 - any failure of a stock constructor is reported, not raised
        return {**row, "status": "not built", "reason": f"{type(error).__name__}: {error}".splitlines()[0][:160]}
    try:
        planned = checked_plan(unfuse(model), None, None, world)
    except SurgeryError as error:
        return {**row, "status": "refused", "reason": _short(str(error).removeprefix("surgery.tensor_parallel: "))}
    count = sum(all_reduces(style) for _, _, plan in planned for style in plan.values())
    if family is not None and family.tp.all_reduces is not None:  # counts a module run twice per forward twice
        count = family.tp.all_reduces(family.config())
    if family is not None and family.tests.flex_backward:  # how its backward was proven, beside its errors
        row["reason"] = (f"flex attention has no CPU backward (torch 2.13): gradients through diffusers' "
                         f"`{family.tests.flex_backward}` backend on the block mask made dense; forward with both")
    return {**row, "status": "sharded" if family else "planned, unproven", "all_reduces": count,
            "per_block": per_block(model, planned)}


def per_block(model, planned) -> str:
    """All-reduces per call of each kind of block, read off its plan (`Kind n`, kinds in model order); a kind whose
    block resolves its own partial sums (an input and output style on the block) is marked `*`: its count is one per
    output, the fewest stock placements allow (each output DTensor is resolved on its own)."""
    kinds: dict[str, str] = {}
    for path, plan in block_plans(model, planned).items():
        if not path:
            continue
        own = plan.get("")
        mark = "*" if isinstance(own, PrepareModuleInputOutput) else ""
        kinds.setdefault(type(model.get_submodule(path)).__name__,
                         f"{sum(all_reduces(style) for style in plan.values())}{mark}")
    return ", ".join(f"{kind} {n}" for kind, n in kinds.items())


def _short(reason: str) -> str:
    """A refusal as the table shows it: one line, without the list of known plans and the advice that ends every one."""
    reason = re.sub(r" \(known: [^)]*\)", "", " ".join(reason.split()))
    return reason.split(". Register a plan")[0].split(" Register one")[0].rstrip(".")


def sharded_families() -> list:
    """The registered families the proof lists as sharded, in the registry's order: what the README's table, notebook
    04 and the conformance suite's readers take as supported."""
    sharded = {r["class"] for r in read_proof()["classes"] if r["status"] == "sharded"}
    return [f for f in families().values() if f.variants and model_class(f).__name__ in sharded]


def document(proof: dict) -> str:
    return (
        "# Families: every diffusers transformer class\n\n"
        "Generated by `python tests/families/proof.py` into `surgery/app/families.json` (what "
        "`surgery families` prints) and this page. " + summary(proof) + " A class is sharded only where a registered "
        "family's conformance suite ran it: unfused == stock forward and backward, then real gloo tensor parallelism "
        "at world 2 and 4 against the single-device model (the last columns: the largest relative error of the "
        "forward and the gathered gradients), with exactly the all-reduces the family declares. Every other class is "
        "built on meta (its defaults), unfused and planned as `surgery.tensor_parallel` plans it; a refusal is the "
        "plan step's own message. All-reduces per forward are those of the family's default published config, read "
        "off the plan; per block, per call of each kind of block, `*` where the block takes an input style and "
        "resolves its partial sums once per output (the fewest stock placements allow: DTensor resolves each output on "
        "its own). FLUX.3's joint single block keeps 2 (its attention's and its feed-forward's): resolved at its two "
        "outputs instead, the same 2 all-reduces would carry half the bytes in forward, but DTensor's backward then "
        "fails where the last block's text output is discarded (its split's gradient mixes a plain zero tensor with "
        "a DTensor). Where a family's attention runs flex attention, which has no backward on CPU (AnyFlow-FAR, "
        "Kandinsky 6 SR), the sharded and whole forwards are compared with the stock kernel and again, with the "
        "gradients, with diffusers' native backend on the flex block mask made dense (`Tests.flex_backward`): the "
        "plan is the same for both kernels, and the dense mask reads the listed blocks as compiled flex does.\n\n" + table(proof["classes"]) + "\n"
    )


def write_proof(rows: list[dict]) -> None:
    """Writes the proof (`rows`: `class_status` rows, those of sharded classes with their conformance `errors` per
    world), then docs/families.md and the README's table from it."""
    proof = {"diffusers": diffusers.__version__, "torch": torch.__version__.split("+")[0], "classes": rows}
    proof_path().write_text(json.dumps(proof, indent=1) + "\n")
    DOC.write_text(document(proof))
    text = README.read_text()
    start, end = text.index(README_BEGIN) + len(README_BEGIN), text.index(README_END)
    README.write_text(text[:start] + "\n" + readme_table() + "\n" + text[end:])


def rebuilt_table(world: int) -> str:
    """`surgery families --rebuild`: the plan step for every installed class, anew (minutes; errors need the suite)."""
    return table([class_status(cls, world) for cls in transformer_classes()])


def readme_table() -> str:
    """The README's families: one row per kind of support, the `--model` names of the families the proof lists as
    sharded (docs/families.md has every class, with the reasons of those refused)."""
    kinds: dict[str, list[str]] = {}
    for family in sharded_families():
        # without rewrites of its own a family may still hold a class another family's rewrite unfuses (diffusers'
        # FeedForward with a SwiGLU: Stable Audio's)
        fuses = family.rewrites or find_modules(model_on_meta(family, family.config()), fused=True)
        kind = ("unfused, then sharded with stock styles" if fuses
                else "nothing fused: sharded with stock styles as is")
        kinds.setdefault(kind, []).append(f"`{family.name}` ({model_class(family).__name__})")
    rows = ["| support | families (`--model` name, diffusers class) |", "|---|---|"]
    rows += [f"| {kind} | {', '.join(names)} |" for kind, names in kinds.items()]
    return "\n".join(rows)


def readme_section(text: str) -> str:
    return text[text.index(README_BEGIN) + len(README_BEGIN):text.index(README_END)].strip()
