"""join(): ranks with uneven amounts of data, on real multi-rank launches, checked against numpy."""

from __future__ import annotations

import re
import time

import pytest
from harness import run_ranks


@pytest.mark.parametrize("np_, controller", [(2, "mpi"), (3, "mpi"), (3, "tcp")])
def test_join_lets_ranks_with_less_data_finish_and_the_others_reduce_over_ranks_with_data(
        np_, controller):
    """Uneven steps, every reduce op, fusion, allgather, broadcast, the errors for a joined root
    and alltoall, a request submitted before joining, join twice, shutdown during join."""
    out = run_ranks(np_, "tests/workers/join_core.py", timeout=180,
                    controller=controller).stdout
    for rank in range(np_):
        assert f"[rank {rank}] join core OK" in out, out
    for rank in range(np_ - 1):
        for case in ("broadcast from a joined root", "alltoall while a rank has joined",
                     "join while a rank shuts down"):
            assert f"[rank {rank}] {case}: got the expected error" in out, out


def test_session_allreduce_completes_while_the_other_rank_is_in_join():
    out = run_ranks(2, "tests/workers/join_tf.py", timeout=300).stdout
    for rank in range(2):
        assert f"[rank {rank}] join tf OK" in out, out


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
