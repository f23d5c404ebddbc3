"""Every sharded family at its published width, by registration (`tests/workers/family_width_worker.py`).

Each family's widest published config, cut to one block of each kind (widths, heads, MLP ratios and embedders as
published; only the depth cut, and token counts no cut tensor depends on: `few_tokens`; 4 image and 4 text
tokens), is sharded by `surgery.tensor_parallel` and compared with
the single-device fused model: fp32 forward, input and parameter gradients, and the sharded model cast to bf16
against the whole one cast to bf16. Tiny test configs never hold a tensor past 2**24 elements, where float32 index
arithmetic stops being exact; these do, wherever a published model has one: the largest tensor the run cuts (a fused
weight `unfuse` slices, or a weight the plan shards) must pass 2**24 exactly where the largest of any published
variant does.

What runs is read off the registry on meta (`family_width_worker.runs`): the widest variant whose model fits `CAP`,
every kind of block in one model where they fit together, else one model per kind (each in the widest variant where
it fits). Each run's single-device reference is computed once, then the model is sharded over 2 ranks
(`test_world_2`), then over 4 (`test_world_4`), in one job of 4 processes (`W.WORLDS`). Marker `width`: the heavy
tier's published widths, run by `.ci/run` after the rest of the heavy tier, alone (one model at a time: docs/width.md
has each run's seconds and memory). `SURGERY_WIDTH_FAMILIES=a,b` runs those families alone;
`SURGERY_WIDTH_RECORD=1` (`.ci/width`) writes each family's measured errors into docs/width.json and regenerates the
table docs/width.md from it (`record`).
"""

from __future__ import annotations

import functools
import json
import os

import pytest
from diffusers.utils import is_torchvision_available
from parameterized import parameterized

import family_width_worker as W
from conformance_worker import BF16_TOL, FP32_TOL, ROUNDING_SPREAD, conformant_families, grad_tolerance

from surgery.core.registry import families
from surgery.testing import run_on_cpu_ranks

# parameters per model: rank 0's peak is two fp32 copies (weights and reference gradients) while the other ranks wait
# (the worker's docstring). Measured at world 2 (docs/width.md): rank 0 peaks at 6.1 GB for FLUX.2-klein-9B's 791 M
# double block, the two ranks' peaks sum to 11.2 GB at most (the file pages the ranks map counted); the tier's share
# of this machine is ~9 GB. Kandinsky 6's text blocks (1284 M with the visual block they feed) and Cosmos 3's one
# layer (1650 M) exceed it.
CAP = 850_000_000
JOB = 2_500_000_000  # parameters per rank job: a job's processes start once (~10 s), and free their memory at the end
# torch refuses the sharded forward under autograd (an in-place write into a view): CogVideoX-5b's RoPE rotates q/k in
# place into the per-head norm's output, which DTensor's to_local returns as a view (tests/families/test_cogvideox.py
# asserts the refusal); ConsisID's blocks are CogVideoX's, with its processor. Forward and bf16 are compared under
# no_grad there.
AUTOGRAD_REFUSED = {"cogvideox", "consisid"}
TABLE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "width.md")


@functools.lru_cache(maxsize=None)
def plan() -> dict[str, tuple[list[W.Run], int, set[str]]]:
    """Each family's runs within `CAP` (see `family_width_worker.runs`); `SURGERY_WIDTH_FAMILIES=a,b` runs only
    those (to rerun one family without the others of its job)."""
    chosen = os.environ.get("SURGERY_WIDTH_FAMILIES")
    names = chosen.split(",") if chosen else [f.name for f in conformant_families()]
    return {name: W.runs(families()[name], CAP) for name in names}


def jobs() -> list[list[W.Run]]:
    """The runs in registry order, cut into as few jobs of about equal parameters as keep each within `JOB`."""
    every = [run for runs, _, _ in plan().values() for run in runs]
    share = sum(r.parameters for r in every) / max(1, -(-sum(r.parameters for r in every) // JOB))
    out: list[list[W.Run]] = [[]]
    for run in every:
        if out[-1] and sum(r.parameters for r in out[-1]) + run.parameters / 2 > share and run.family != out[-1][-1].family:
            out.append([])
        out[-1].append(run)
    return out


@functools.lru_cache(maxsize=None)
def job(index: int) -> tuple[list[list[dict]] | None, BaseException | None]:
    """One job's results by rank (each run at every world of `W.WORLDS`: one reference, then 2 ranks, then 4), or
    the error it raised: kept either way, so that a failed job fails each of its families once instead of running
    again for each."""
    try:
        return run_on_cpu_ranks(W.run, max(W.WORLDS), jobs()[index], True, timeout=3600), None
    except Exception as error:  # noqa: BLE001 - re-raised by every test of the job
        return None, error


def results(name: str, world: int) -> list[tuple[W.Run, list[dict]]]:
    """(run, results by rank) at `world` for each run of family `name`."""
    out = []
    for index, runs in enumerate(jobs()):
        positions = [i for i, run in enumerate(runs) if run.family == name]
        if positions:
            by_rank, error = job(index)
            if error is not None:
                raise error
            out += [(runs[i], [r[i][world] for r in by_rank[:world]]) for i in positions]
    return out


def check(name: str, world: int) -> None:
    runs, published, left = plan()[name]
    found = W.candidates(families()[name])
    for kind in sorted(left):  # a kind of block no run holds: its one block exceeds CAP in every published variant
        smallest = min(run.parameters for _, run in found if kind in run.kinds and run.largest_cut)
        print(f"{name}: {kind} left out (one block: {smallest / 1e6:.0f}M parameters at least)")
        assert smallest > CAP, (name, kind, smallest)
    done = results(name, world)
    assert done, f"{name}: no model of its published width fits {CAP} parameters"
    tolerance = grad_tolerance(families()[name])
    largest = 0
    for run, by_rank in done:
        print(f"{name} {run.variant} {run.kinds} {run.parameters / 1e6:.0f}M: {by_rank[0]}")
        first = by_rank[0]
        record(name, world, run, by_rank)
        if "tokens" not in first and not is_torchvision_available() and all(
                "'transforms' is not defined" in e for e in first["token_errors"]):
            pytest.skip(f"{name}: stock diffusers' forward needs torchvision, not installed: {first['token_errors']}")
        assert "tokens" in first, (name, run.variant, first["token_errors"])
        assert "refused" not in first, first["refused"]
        assert first["largest_reached"], (f"{name} {run.variant} {run.kinds}: the stock output depends on no tensor "
                                          f"the run cuts: it proves nothing about its blocks")
        largest = max(largest, first["largest_reached"])
        for rank, r in enumerate(by_rank):
            where = f"{name} {run.variant} {run.kinds} world {world} rank {rank}"
            assert r["forward"] <= FP32_TOL, (where, r)
            assert r["bf16"] <= BF16_TOL, (where, r)
            if "autograd_refused" in r:
                assert name in AUTOGRAD_REFUSED, (where, r["autograd_refused"])
                continue
            if max(r["grads"], r["inputs"]) > tolerance:  # rounding, or a wrong cut: float64 tells (the worker's
                f64 = r.get("float64")                    # `float64_errors`, as the conformance suite's)
                assert f64 is not None, (where, r)
                assert f64["sharded"] <= max(tolerance, ROUNDING_SPREAD * f64["stock"]), (
                    f"{where}: gradients {max(r['grads'], r['inputs']):.2e} from the stock model's, "
                    f"{f64['sharded']:.2e} from float64, where the stock model's are {f64['stock']:.2e}: {f64['names']}")
    if largest <= W.PAST < published:  # forced only where no model past 2**24 fits the cap
        smallest = min(run.parameters for run in (r for _, r in found) if run.largest_cut > W.PAST)
        print(f"{name}: past 2**24 left out (the smallest such model: {smallest / 1e6:.0f}M)")
        assert smallest > CAP, (f"{name}: the largest tensor cut holds {largest} elements, the widest published "
                                f"model's {published}, and a model of {smallest} parameters would pass 2**24")
    else:
        assert (largest > W.PAST) == (published > W.PAST), (
            f"{name}: the largest tensor cut holds {largest} elements; the widest published model's, {published}: "
            f"2**24 is {W.PAST}")


def record(name: str, world: int, run: W.Run, by_rank: list[dict]) -> None:
    """With `SURGERY_WIDTH_RECORD=1`: this run's measured errors (the worst rank's) into docs/width.json, and
    docs/width.md regenerated from all that file holds."""
    if not os.environ.get("SURGERY_WIDTH_RECORD") or "forward" not in by_rank[0]:
        return
    path = TABLE.replace(".md", ".json")
    table = json.load(open(path)) if os.path.exists(path) else {}
    key = f"{name} {run.variant} {'+'.join(run.kinds) or '-'}"
    row = table.setdefault(key, {"family": name, "variant": run.variant, "kinds": "+".join(run.kinds) or "-"})
    row["parameters"] = run.parameters
    row[f"w{world}"] = {k: max(r[k] for r in by_rank) if k in by_rank[0] else None  # None: torch refused autograd
                        for k in ("forward", "grads", "inputs", "bf16")}
    arbitrated = [r["float64"] for r in by_rank if "float64" in r]
    if arbitrated:
        row[f"w{world}"]["float64"] = {k: max(f[k] for f in arbitrated) for k in ("sharded", "stock")}
    if "zero_heads" in by_rank[0]:
        row[f"w{world}"]["zero_heads"] = True
    row[f"w{world}"].update({
        "largest": by_rank[0]["largest_reached"], "seconds": by_rank[0]["seconds"],
        "peak_gb": round(sum(r["peak"] for r in by_rank) / 2**30, 2)})
    table = dict(sorted(table.items()))  # a family recorded for the first time in its place, in both files
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    with open(TABLE, "w") as f:
        f.write(W.markdown(table, CAP))


def _name(func, num, params):
    return f"{func.__name__}_{params.args[0].replace('-', '_').replace('.', '_')}"


FAMILIES = [(f.name,) for f in conformant_families()]


# Under `expand`: its generated cases copy the function's marks.
@parameterized.expand(FAMILIES, name_func=_name)
@pytest.mark.width
def test_world_2(name):
    if name not in plan():
        pytest.skip("not in SURGERY_WIDTH_FAMILIES")
    check(name, 2)


@parameterized.expand(FAMILIES, name_func=_name)
@pytest.mark.width
def test_world_4(name):
    if name not in plan():
        pytest.skip("not in SURGERY_WIDTH_FAMILIES")
    check(name, 4)
