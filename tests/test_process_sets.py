"""Process sets on real ranks, over MPI and TCP, 3 and 4 ranks (tests/workers/process_sets.py):
collectives of overlapping sets and of the global set in flight together against numpy, fusion
within a set only, the errors (a rank outside the set, members that disagree, add_process_set
calls that disagree, join), and training on a set against one process on its global batch."""

from __future__ import annotations

import pytest
from harness import python_for, run_ranks


@pytest.mark.parametrize("np_, controller", [(3, "mpi"), (4, "mpi"), (3, "tcp"), (4, "tcp")])
def test_process_set_collectives_match_numpy_and_fail_clearly(np_, controller):
    """Sets {0, 2} (init) and {1, 2} or {1, 2, 3} (add_process_set): every collective of Horovod's
    API on a set against numpy, fused only within a set, every error named on every rank, and a
    DistributedGradientTape / TF1 DistributedOptimizer step equal to one process."""
    out = run_ranks(np_, "tests/workers/process_sets.py", timeout=300, controller=controller).stdout
    assert out.count("] OK") == np_, out
    assert out.count("concurrent sets: 9 tensors fused in 3 groups") == np_ - 1, out  # B: all but 0


def test_stalled_set_collective_names_its_missing_members_only():
    """A collective of {1, 2, 3} submitted by ranks 1 and 2 only fails after
    PERSEUS_STALL_SHUTDOWN_SECS naming rank 3 (not rank 0, outside the set); nothing hangs."""
    out = run_ranks(4, "tests/workers/process_sets.py", "stall", timeout=120,
                    env={"PERSEUS_STALL_SHUTDOWN_SECS": "2"}).stdout
    assert out.count("] OK") == 4, out


def test_process_sets_on_tf_2_15():
    """The TF 2.15 op library carries the process_set_id attribute: queries, the concurrent
    step and a DistributedGradientTape on a set, on 3 ranks over TCP (no MPI there)."""
    out = run_ranks(3, "tests/workers/process_sets.py", "basic", timeout=300, controller="tcp",
                    python=python_for("tf215")).stdout
    assert out.count("] OK") == 3, out
