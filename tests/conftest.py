import inspect
import os
import sys

import pytest

# The tests import their workers (what the ranks run) and shared helpers by module name; the ranks inherit
# this path.
TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(TESTS, "workers"), os.path.join(TESTS, "support")]

# The heavy tier (`@pytest.mark.heavy`, or a module's `pytestmark`): jobs of 4 ranks, published widths (on
# meta too), the notebooks, torch.compile of every family, plan-only sweeps over every published variant. The README's
# command leaves them out (pyproject's addopts: -m "not heavy"); CI runs them second (.ci/run). Both run in two
# processes (pytest-xdist `-n 2 --dist loadfile`: a file's tests share one process, so a job cached for a file's tests
# runs once). A case of a
# `parameterized.expand` test whose `world` argument is 4 is marked here: parameterized's generated methods take no
# decorator of their own.
HEAVY_WORLD = 4


def pytest_configure(config):
    # Under pytest-xdist each worker gets its share of the cores: torch's default, every core per process, would
    # oversubscribe them (n workers x n threads) and its OpenMP threads spin waiting for each other.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def _world(item) -> int | None:
    function = getattr(item, "obj", None)
    original = getattr(function, "place_as", None)  # set by parameterized.expand on each generated case
    if original is None or "world" not in inspect.signature(original).parameters:
        return None
    case = inspect.getclosurevars(function).nonlocals.get("p")
    if case is None:
        return None
    index = list(inspect.signature(original).parameters).index("world") - 1  # after self
    return case.args[index] if index < len(case.args) else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _world(item) == HEAVY_WORLD:
            item.add_marker(pytest.mark.heavy)
