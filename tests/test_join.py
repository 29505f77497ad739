"""join(): ranks with uneven amounts of data, on real multi-rank launches, checked against numpy.

One launch per configuration (LAUNCHES) runs the named cases of tests/workers/join_core.py that
the selected tests ask of it: each case is a test of its own, `-k` launches only what it
selects."""

from __future__ import annotations

import re
import time

import pytest
from harness import run_cases, run_ranks, selected_cases, worker_cases

WORKER = "tests/workers/join_core.py"
CASES = worker_cases(WORKER)
SESSION = "session_allreduce_while_others_join"  # TensorFlow: on 2 ranks only
CORE = [case for case in CASES if case != SESSION]
# name: ranks, controller, the cases it runs (one launch each).
LAUNCHES = {"2ranks-mpi": (2, "mpi", CASES), "3ranks-mpi": (3, "mpi", CORE),
            "3ranks-tcp": (3, "tcp", CORE)}


@pytest.fixture(scope="module")
def join_launch(request):
    """The launch LAUNCHES[request.param] (a test's indirect parameter), once for the module,
    running the cases the selected tests ask of it."""
    ranks, controller, cases = LAUNCHES[request.param]
    return run_cases(ranks, WORKER, selected_cases(request, cases), timeout=300,
                     controller=controller)


@pytest.mark.parametrize("case", CORE)
@pytest.mark.parametrize("join_launch", list(LAUNCHES), indirect=True)
def test_join_lets_ranks_with_less_data_finish_and_the_others_reduce_over_ranks_with_data(
        join_launch, case):
    """Uneven steps, every reduce op, fusion, allgather, broadcast, the errors for a joined root
    and alltoall, a request submitted before joining, join twice, shutdown during join."""
    join_launch.check(case)


@pytest.mark.parametrize("case", [SESSION])
@pytest.mark.parametrize("join_launch", ["2ranks-mpi"], indirect=True)
def test_session_allreduce_completes_while_the_other_rank_is_in_join(join_launch, case):
    join_launch.check(case)


def test_rank_killed_during_join_ends_the_job_within_30_seconds_naming_it():
    result = run_ranks(2, "tests/workers/join_killed.py", timeout=60, expect_failure=True)
    ended = time.time()
    killed = re.search(r"\[rank 1\] KILLED_AT ([0-9.]+)", result.stdout)
    assert killed, result.stdout
    assert "UNEXPECTED" not in result.stdout, result.stdout
    assert ended - float(killed.group(1)) < 30, result.stdout
    # mpirun ends rank 0 before it can notice: mpirun's own report must name rank 1 and the
    # signal (a bare "rank 1" would also match lines that name it for another reason).
    assert re.search(r"process rank 1 with PID \d+ on node \S+ exited on\s+signal 9",
                     result.stdout), result.stdout
