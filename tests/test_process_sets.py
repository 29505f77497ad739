"""Process sets on real ranks, over MPI and TCP, 3 and 4 ranks (tests/workers/process_sets.py):
collectives of overlapping sets and of the global set in flight together against numpy, fusion
within a set only, the errors (a rank outside the set, members that disagree, add_process_set
calls that disagree, join), and training on a set against one process on its global batch.

One launch per configuration (LAUNCHES) runs the worker's named cases that the selected tests
ask of it: each case is a test of its own and `-k` launches only what it selects."""

from __future__ import annotations

import pytest
from harness import python_for, run_cases, selected_cases, worker_cases

WORKER = "tests/workers/process_sets.py"
CASES = worker_cases(WORKER)
SETS = [case for case in CASES if case != "stall"]  # A and B registered: all but the stall
# The TF 2.15 op library carries the process_set_id attribute: queries, the concurrent step and
# a DistributedGradientTape on a set.
TF215 = ["queries", "concurrent_step", "tape", "last_global_allreduce"]
STALL_ENV = {"PERSEUS_STALL_SHUTDOWN_SECS": "2"}
# name: ranks, controller, TensorFlow, environment, timeout, the cases it runs.
LAUNCHES = {
    "3ranks-mpi": (3, "mpi", "main", {}, 300, SETS),
    "4ranks-mpi": (4, "mpi", "main", {}, 300, SETS),
    "3ranks-tcp": (3, "tcp", "main", {}, 300, SETS),
    "4ranks-tcp": (4, "tcp", "main", {}, 300, SETS),
    "4ranks-mpi-stall": (4, "mpi", "main", STALL_ENV, 120, ["stall"]),
    "tf215-3ranks-tcp": (3, "tcp", "tf215", {}, 300, TF215),
}


@pytest.fixture(scope="module")
def sets_launch(request):
    """The launch LAUNCHES[request.param] (a test's indirect parameter), once for the module."""
    ranks, controller, version, env, timeout, cases = LAUNCHES[request.param]
    return run_cases(ranks, WORKER, selected_cases(request, cases), timeout=timeout, env=env,
                     controller=controller, python=python_for(version))


def check_fusion_reported(launch, case: str) -> None:
    """Besides its verdict, the concurrent step prints its fusion: every rank of B (all but
    rank 0) fused its 9 grouped tensors in 3 groups."""
    if case == "concurrent_step":
        out = launch.result.stdout
        assert out.count("concurrent sets: 9 tensors fused in 3 groups") == launch.ranks - 1, out


@pytest.mark.parametrize("case", SETS)
@pytest.mark.parametrize("sets_launch", ["3ranks-mpi", "4ranks-mpi", "3ranks-tcp", "4ranks-tcp"],
                         indirect=True)
def test_process_set_collectives_match_numpy_and_fail_clearly(sets_launch, case):
    """Sets {0, 2} (init) and {1, 2} or {1, 2, 3} (add_process_set): every collective of Horovod's
    API on a set against numpy, fused only within a set, every error named on every rank, and a
    DistributedGradientTape / TF1 DistributedOptimizer / Keras step equal to one process."""
    sets_launch.check(case)
    check_fusion_reported(sets_launch, case)


@pytest.mark.parametrize("case", ["stall"])
@pytest.mark.parametrize("sets_launch", ["4ranks-mpi-stall"], indirect=True)
def test_stalled_set_collective_names_its_missing_members_only(sets_launch, case):
    """A collective of {1, 2, 3} submitted by ranks 1 and 2 only fails after
    PERSEUS_STALL_SHUTDOWN_SECS naming rank 3 (not rank 0, outside the set); nothing hangs."""
    sets_launch.check(case)


@pytest.mark.parametrize("case", TF215)
@pytest.mark.parametrize("sets_launch", ["tf215-3ranks-tcp"], indirect=True)
def test_process_sets_on_tf_2_15(sets_launch, case):
    """The TF 2.15 op library carries the process_set_id attribute: queries, the concurrent
    step and a DistributedGradientTape on a set, on 3 ranks over TCP (no MPI there)."""
    sets_launch.check(case)
    check_fusion_reported(sets_launch, case)
