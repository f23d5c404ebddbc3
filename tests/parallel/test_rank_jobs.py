"""`surgery.testing.run_on_cpu_ranks`, the harness of every multi-process test: a job past its time limit fails with
every rank's stacks instead of hanging the suite, a job that ends returns each rank's result, and the ranks of a
run that is killed die with it (they held 17 GB after a killed 4-rank job, and the next jobs ran out of memory)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rank_job_worker
from surgery.testing import run_on_cpu_ranks


def test_a_job_past_its_time_limit_fails_with_every_ranks_stacks(capfd):
    started = time.monotonic()
    # 20 s: the time starts once the forkserver is up, and a rank forked from it reaches rank 1's broadcast in a
    # second or two (its imports are the server's) even on a loaded machine
    with pytest.raises(TimeoutError, match=r"still running after 20 s \(ranks with a result: \[\]\)"):
        run_on_cpu_ranks(rank_job_worker.stuck, 2, timeout=20)
    assert time.monotonic() - started < 180  # killed, not left to its 600 s sleep
    stacks = capfd.readouterr().err
    for rank in (0, 1):  # each rank's stacks under its own heading, one after the other (not interleaved)
        assert f"run_on_cpu_ranks: rank {rank} (pid" in stacks, stacks[-3000:]
    rank_1 = stacks[stacks.index("run_on_cpu_ranks: rank 1 (pid"):]
    assert 'rank_job_worker.py", line' in rank_1 and " in stuck" in rank_1, rank_1[-3000:]
    assert " in broadcast" in rank_1, rank_1[-3000:]  # where rank 1 waited


def test_a_job_that_ends_returns_each_ranks_result():
    assert run_on_cpu_ranks(rank_job_worker.fine, 2, timeout=120) == [2, 2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (killed, not yet reaped by init) holds no memory
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the ranks die with their parent on Linux only")
def test_the_ranks_of_a_killed_run_die_with_it(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(rank_job_worker.__file__).parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    parent = subprocess.Popen([sys.executable, rank_job_worker.__file__, str(tmp_path)], env=env)
    try:
        pids = []
        deadline = time.monotonic() + 180
        while len(pids) < 2 and time.monotonic() < deadline:  # both ranks started
            pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid") if p.read_text()]
            time.sleep(0.2)
        assert len(pids) == 2, "the ranks did not start"
        assert all(_alive(pid) for pid in pids)
        parent.send_signal(signal.SIGKILL)  # as a CI timeout or an out-of-memory kill ends a test run
        parent.wait()
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in pids if _alive(pid)], "ranks outlived the run that started them"
    finally:
        parent.kill()
        for p in tmp_path.glob("rank*.pid"):
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
