"""Writes the proof of what shards, from a real run: `python tests/families/proof.py`.

The plan step for every diffusers transformer class (`surgery.app.coverage.class_status`) and each registered
family's gloo run at world 2 and 4, checked as the conformance suite's `TensorParallel` checks it, go into
`surgery/app/families.json` (what `surgery families` prints), docs/families.md and the README's table. Nothing is
written where a family fails or is not run: run it after adding or changing a family (about as long as the
conformance suite's two tensor-parallel jobs); tests/app/test_families_proof.py fails while it is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "workers"), str(TESTS / "support")]  # as tests/conftest.py gives pytest

import conformance_worker as W  # noqa: E402
from surgery.app import coverage  # noqa: E402
from surgery.testing import run_on_cpu_ranks  # noqa: E402

WORLDS = (2, 4)


def proven_errors(world: int) -> dict[str, dict[str, float]]:
    """`{family: {"forward", "gradients"}}`: the largest relative errors over the ranks of its world-`world` run.
    Raises where any family fails a check: no proof of a failure is written."""
    errors: dict[str, dict[str, float]] = {}
    for by_case in run_on_cpu_ranks(W.run, world, W.family_cases(tp_only=True), {}):
        for key, r in by_case.items():
            family = W.families()[key.partition("/")[0]]
            gradients = max(r["param_grads"], r["input_grads"])
            failed = [what for what, bad in (
                ("forward", r["forward"] > W.FP32_TOL),
                ("gradients", gradients > W.grad_tolerance(family)),
                ("bytes per rank", r["bytes"] != r["expected_bytes"]),
                ("all-reduces", r["expected_all_reduces"] is not None
                 and r["collectives"] != {"all_reduce": r["expected_all_reduces"]}))
                if bad]
            if failed:
                raise AssertionError(f"{key} at world {world} fails its {', '.join(failed)}: {r}")
            seen = errors.setdefault(family.name, {"forward": 0.0, "gradients": 0.0})
            seen["forward"] = max(seen["forward"], float(f"{r['forward']:.1e}"))
            seen["gradients"] = max(seen["gradients"], float(f"{gradients:.1e}"))
    return errors


def main() -> None:
    missing = [f.name for f in W.families().values() if f.variants and not f.tests.configs]
    if missing:
        raise SystemExit(f"families with published variants but no test configs, so nothing proves them: {missing}")
    errors = {world: proven_errors(world) for world in WORLDS}
    rows = []
    for cls in coverage.transformer_classes():
        row = coverage.class_status(cls)
        if row["family"]:
            if row["status"] != "sharded":
                raise SystemExit(f"{row['family']} ({row['class']}) is registered but {row['status']}: {row['reason']}")
            row["errors"] = {str(world): errors[world][row["family"]] for world in WORLDS}
        rows.append(row)
    coverage.write_proof(rows)
    print(f"wrote {coverage.proof_path()}, {coverage.DOC} and the README's table")


if __name__ == "__main__":
    main()
