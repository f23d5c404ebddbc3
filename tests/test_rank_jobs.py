"""`surgery.testing.run_on_cpu_ranks`, the harness of every multi-process test: a job past its time limit fails with
every rank's stacks instead of hanging the suite, and a job that ends returns each rank's result."""

import time

import pytest

import rank_job_worker
from surgery.testing import run_on_cpu_ranks


def test_a_job_past_its_time_limit_fails_with_every_ranks_stacks(capfd):
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"still running after 30 s \(ranks with a result: \[\]\)"):
        run_on_cpu_ranks(rank_job_worker.stuck, 2, timeout=30)  # well past the ranks' start-up
    assert time.monotonic() - started < 90  # killed, not left to its 600 s sleep
    stacks = capfd.readouterr().err
    assert "in stuck" in stacks and "rank_job_worker.py" in stacks, stacks[-2000:]
    assert "broadcast" in stacks  # where rank 1 waited


def test_a_job_that_ends_returns_each_ranks_result():
    assert run_on_cpu_ranks(rank_job_worker.fine, 2, timeout=120) == [2, 2]
