"""The `surgery` command's entry point.

`surgery families` answers from the committed proof (`surgery/app/families.json`: every diffusers transformer class,
sharded or refused, as the conformance suite last proved it) without importing torch, diffusers or the `surgery`
package, whose `__init__` alone takes seconds; every other command, `surgery families --rebuild` included, goes to
`surgery.app.cli`. The proof is written by `python tests/families/proof.py`, and a test
fails when it, the README's table or docs/families.md disagree with the registry.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path


def proof_path() -> Path:
    """The committed proof, found without importing `surgery` (its `__init__` imports torch and diffusers)."""
    return Path(find_spec("surgery").origin).parent / "app" / "families.json"


def read_proof() -> dict:
    return json.loads(proof_path().read_text())


def _error(row: dict, world: int) -> str:
    errors = row.get("errors", {}).get(str(world))
    return f"{max(errors.values()):.1e}" if errors else ""


def table(rows: list[dict]) -> str:
    """One line per class: its family, status, all-reduces per forward of the published default at world 2, the
    largest error (forward, gradients) of the conformance suite's run at world 2 and 4, or the reason it is refused."""
    lines = ["| class | family | status | all-reduces per forward | per block | max error, world 2 / 4 | reason |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        errors = " / ".join(e for e in (_error(r, 2), _error(r, 4)) if e)
        count = "" if r["all_reduces"] is None else str(r["all_reduces"])
        reason = r["reason"].replace("|", "\\|")
        lines.append(f"| {r['class']} | {r['family']} | {r['status']} | {count} | {r.get('per_block', '')} | {errors} | {reason} |")
    return "\n".join(lines)


def summary(proof: dict) -> str:
    """Where the proof comes from, and whether the installed diffusers is the one it was proven with."""
    rows = proof["classes"]
    sharded = sum(r["status"] == "sharded" for r in rows)
    line = (f"{sharded} of {len(rows)} diffusers {proof['diffusers']} transformer classes shard, proven by the "
            f"conformance suite (torch {proof['torch']})")
    installed = version("diffusers")
    if installed != proof["diffusers"]:
        line += (f"; diffusers {installed} is installed here: `surgery families --rebuild` plans its classes anew "
                 "(minutes, unproven)")
    return line + "."


def listing() -> str:
    """What `surgery families` prints: the proof's table and where it comes from."""
    proof = read_proof()
    return f"{table(proof['classes'])}\n{summary(proof)}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["families"]:
        print(listing())
        return 0
    from surgery.app.cli import main as command  # the package itself: torch, diffusers and every family

    return command(argv)


if __name__ == "__main__":
    sys.exit(main())
