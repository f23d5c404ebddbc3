"""Every sharded family at its published width, by registration (`tests/workers/family_width_worker.py`).

Each family's published configs, cut to one block of each kind (widths, heads, MLP ratios and embedders as
published; only the depth cut, 4 image and 2 text tokens), are sharded by `surgery.tensor_parallel` and compared with
the single-device fused model: fp32 forward, input and parameter gradients. Tiny test configs never hold a tensor
past 2**24 elements, where float32 index arithmetic stops being exact; these do, wherever a published model has one:
the largest tensor the run cuts (a fused weight `unfuse` slices, or a weight the plan shards) must pass 2**24
exactly where the largest of any published variant does.

What runs is read off the registry on meta (`family_width_worker.runs`): the widest variant whose model fits the
tier's parameter cap, every kind of block in one model where they fit together, else one model per kind (each in the
widest variant where it fits). Two tiers:
- heavy (built for CI; for now in the width marker, see `test_world_2_fp32`): world 2, fp32, `HEAVY_CAP` per model; a rank job per few families, each model freed before
  the next. A family whose every published-width block exceeds the cap is held by the width tier alone
  (`test_world_2_fp32` lists them, and fails if the cap leaves one out needlessly).
- width (`python -m pytest -q tests -m width`, by hand: ~8 GB): world 4, fp32 and the sharded model cast to bf16,
  `WIDTH_CAP`, every family.
"""

from __future__ import annotations

import functools
import os

import pytest
from parameterized import parameterized

import family_width_worker as W
from conformance_worker import BF16_TOL, FP32_TOL, conformant_families, grad_tolerance
from surgery.core.registry import families
from surgery.testing import run_on_cpu_ranks

# parameters per model: rank 0 holds the fp32 weights and their reference gradients, the others their shards, ~12
# bytes a parameter in all (measured: QwenImage's block at 380 M parameters, 5.9 GB over both ranks' peaks)
HEAVY_CAP = 400_000_000
WIDTH_CAP = 850_000_000
JOB = 2_500_000_000  # parameters per rank job: a job's processes start once (~10 s), and free their memory at the end


@functools.lru_cache(maxsize=None)
def plan(cap: int) -> dict[str, tuple[list[W.Run], int, set[str]]]:
    """Each family's runs within `cap` (see `family_width_worker.runs`); `SURGERY_WIDTH_FAMILIES=a,b` runs only
    those (to rerun one family without the others of its job)."""
    chosen = os.environ.get("SURGERY_WIDTH_FAMILIES")
    names = chosen.split(",") if chosen else [f.name for f in conformant_families()]
    return {name: W.runs(families()[name], cap) for name in names}


def jobs(cap: int) -> list[list[W.Run]]:
    """The runs in registry order, cut into as few jobs of about equal parameters as keep each within `JOB`."""
    every = [run for runs, _, _ in plan(cap).values() for run in runs]
    share = sum(r.parameters for r in every) / max(1, -(-sum(r.parameters for r in every) // JOB))
    out: list[list[W.Run]] = [[]]
    for run in every:
        if out[-1] and sum(r.parameters for r in out[-1]) + run.parameters / 2 > share and run.family != out[-1][-1].family:
            out.append([])
        out[-1].append(run)
    return out


@functools.lru_cache(maxsize=None)
def job(cap: int, index: int, world: int, half: bool) -> tuple[list[list[dict]] | None, BaseException | None]:
    """One job's results by rank, or the error it raised: kept either way, so that a failed job fails each of its
    families once instead of running again for each."""
    try:
        return run_on_cpu_ranks(W.run, world, jobs(cap)[index], half, timeout=3600), None
    except Exception as error:  # noqa: BLE001 - re-raised by every test of the job
        return None, error


def results(name: str, cap: int, world: int, half: bool) -> list[tuple[W.Run, list[dict]]]:
    """(run, results by rank) for each run of family `name`."""
    out = []
    for index, runs in enumerate(jobs(cap)):
        positions = [i for i, run in enumerate(runs) if run.family == name]
        if positions:
            by_rank, error = job(cap, index, world, half)
            if error is not None:
                raise error
            out += [(runs[i], [r[i] for r in by_rank]) for i in positions]
    return out


def check(name: str, cap: int, world: int, half: bool) -> None:
    runs, published, left = plan(cap)[name]
    done = results(name, cap, world, half)
    assert done, f"{name}: no model of its published width fits {cap} parameters"
    tolerance = grad_tolerance(families()[name])
    largest = 0
    for run, by_rank in done:
        print(f"{name} {run.variant} {run.kinds} {run.parameters / 1e6:.0f}M: {by_rank[0]}")
        first = by_rank[0]
        assert "tokens" in first, (name, run.variant, first["token_errors"])
        if "refused" in first:  # heads a mesh of 4 does not divide (SD3.5-large's 38, Z-Image's 30)
            assert world == 4 and "mesh of 4 cannot split" in first["refused"], first["refused"]
            continue
        largest = max(largest, first["largest"])
        for rank, r in enumerate(by_rank):
            where = f"{name} {run.variant} {run.kinds} world {world} rank {rank}"
            assert r["forward"] <= FP32_TOL, (where, r)
            assert r["grads"] <= tolerance, (where, r)
            assert r["inputs"] <= tolerance, (where, r)
            if half:
                assert r["bf16"] <= BF16_TOL, (where, r)
    if world == 2:
        assert largest, f"{name}: every run refused"
    if largest and largest <= W.PAST < published:  # forced only where no model past 2**24 fits the cap
        smallest = min(run.parameters for _, run in W.candidates(families()[name]) if run.largest_cut > W.PAST)
        print(f"{name}: past 2**24 left to the width tier (the smallest such model: {smallest / 1e6:.0f}M)")
        assert smallest > cap, (f"{name}: the largest tensor cut holds {largest} elements, the widest published "
                                f"model's {published}, and a model of {smallest} parameters would pass 2**24")
    elif largest:
        assert (largest > W.PAST) == (published > W.PAST), (
            f"{name}: the largest tensor cut holds {largest} elements; the widest published model's, {published}: "
            f"2**24 is {W.PAST}")


def _name(func, num, params):
    return f"{func.__name__}_{params.args[0].replace('-', '_').replace('.', '_')}"


FAMILIES = [(f.name,) for f in conformant_families()]


# Built for the heavy tier (`pytest.mark.heavy`), held in the width marker until what it found is mended: Allegro's
# fp32 errors (4.2e-6 forward, 7.3e-5 gradients), Bria-Fibo 2's perceiver norm_k gradient (1.5), CogVideoX-5B's
# sharded forward under autograd (an in-place write to a view), ConsisID's and Cosmos 1.0's example inputs at
# published width. Under `expand`: its generated cases copy the function's marks.
@parameterized.expand(FAMILIES, name_func=_name)
@pytest.mark.width
def test_world_2_fp32(name):
    """Where the heavy cap leaves a kind of block out, it must: its one block, in every published variant, makes a
    model of more than `HEAVY_CAP` parameters; the width tier holds it."""
    if name not in plan(HEAVY_CAP):
        pytest.skip("not in SURGERY_WIDTH_FAMILIES")
    runs, _, left = plan(HEAVY_CAP)[name]
    found = W.candidates(families()[name])
    for kind in sorted(left):
        smallest = min(run.parameters for _, run in found if kind in run.kinds and run.largest_cut)
        print(f"{name}: {kind} left to the width tier (one block: {smallest / 1e6:.0f}M parameters at least)")
        assert smallest > HEAVY_CAP, (name, kind, smallest)
    assert not plan(WIDTH_CAP)[name][2], f"{name}: the width tier leaves {plan(WIDTH_CAP)[name][2]} out too"
    if runs:
        check(name, HEAVY_CAP, 2, half=False)


@parameterized.expand(FAMILIES, name_func=_name)
@pytest.mark.width
def test_world_4_fp32_and_bf16(name):
    check(name, WIDTH_CAP, 4, half=True)
