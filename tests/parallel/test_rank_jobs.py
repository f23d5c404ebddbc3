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
    for rank in (0, 1):  # each rank's stacks under its own heading, one after the other (not interleaved)
        assert f"run_on_cpu_ranks: rank {rank} (pid" in stacks, stacks[-3000:]
    rank_1 = stacks[stacks.index("run_on_cpu_ranks: rank 1 (pid"):]
    assert 'rank_job_worker.py", line' in rank_1 and " in stuck" in rank_1, rank_1[-3000:]
    assert " in broadcast" in rank_1, rank_1[-3000:]  # where rank 1 waited


def test_a_job_that_ends_returns_each_ranks_result():
    assert run_on_cpu_ranks(rank_job_worker.fine, 2, timeout=120) == [2, 2]
