"""The native core (perseus_legacy._core) under real multi-rank launches, over both controllers.

Each launch runs one worker script on every rank. core_collectives.py's named cases are tests
of their own over one launch per rank count and controller (`-k alltoall` launches only that
case); the other workers check many things and exit non-zero, naming the rank and what failed.
Every test runs with the MPI controller (perseusrun) and with the TCP controller (perseusrun
--tcp, MPI never initialized).
"""

from __future__ import annotations

import re
import time

import pytest
from harness import CONTROLLERS, run_cases, run_ranks, selected_cases, worker_cases

LAUNCHER = "perseusrun"


COLLECTIVES_WORKER = "tests/workers/core_collectives.py"
COLLECTIVES_CASES = worker_cases(COLLECTIVES_WORKER)
COLLECTIVES_LAUNCHES = [(np_, controller) for controller in CONTROLLERS for np_ in (1, 2, 3, 4)]


@pytest.fixture(scope="module", params=COLLECTIVES_LAUNCHES, ids=lambda p: f"{p[0]}ranks-{p[1]}")
def collectives_launch(request):
    """One launch per rank count and controller runs every selected case of the worker."""
    np_, controller = request.param
    return run_cases(np_, COLLECTIVES_WORKER, selected_cases(request, COLLECTIVES_CASES),
                     launcher=LAUNCHER, timeout=240, controller=controller)


@pytest.mark.parametrize("case", COLLECTIVES_CASES)
def test_collective_matches_numpy_for_every_dtype_op_and_submission_order(
        collectives_launch, case):
    """Every dtype and op, scale factors, outputs given or in place, negative values, uneven
    allgather and alltoall, every broadcast root, empty tensors, shuffled submission from
    threads, fusion (small and large tensors), argument errors, the single-rank shortcut, and
    the calls before init and after shutdown."""
    collectives_launch.check(case)


@pytest.fixture(scope="module", params=CONTROLLERS)
def errors_run(request):
    return run_ranks(3, "tests/workers/core_errors.py", launcher=LAUNCHER, timeout=240,
                     env={"PERSEUS_STALL_WARNING_SECS": "1"}, controller=request.param).stdout


def test_mismatched_requests_fail_on_every_rank_naming_tensor_ranks_and_values(errors_run):
    for case in ("dtype", "shape", "op", "root", "root range", "collective", "trailing dims",
                 "splits", "duplicate"):
        for rank in range(3):
            assert f"[rank {rank}] {case}: got the expected error" in errors_run, errors_run
    for rank in range(3):
        assert f"[rank {rank}] core errors OK" in errors_run, errors_run


def test_stalled_tensor_is_reported_by_rank_0_with_the_missing_rank(errors_run):
    assert "perseus_legacy[rank 0]: WARNING:" in errors_run, errors_run
    assert 'allreduce "stall.x": missing ranks [1] (submitted by ranks [0, 2]' in errors_run, \
        errors_run
    assert not re.search(r"perseus_legacy\[rank [12]\]", errors_run), "only rank 0 warns"
    counted = {int(r): int(n) for r, n in
               re.findall(r"\[rank (\d)\] stall warnings counted: (\d+)", errors_run)}
    assert counted.keys() == {0, 1, 2} and counted[0] >= 1, errors_run
    assert counted[1] == counted[2] == 0, errors_run


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_rank_leaving_early_fails_the_others_pending_ops_naming_it(controller):
    out = run_ranks(3, "tests/workers/core_shutdown_early.py", launcher=LAUNCHER,
                    timeout=180, controller=controller).stdout
    # Over TCP, rank 1's closed connection may be noticed before its goodbye is read: the
    # error then says so, naming rank 1 and its address.
    named = r"rank 1 (shut down|\(127\.0\.0\.1:\d+\) closed its connection)"
    for rank in (0, 2):
        assert f"[rank {rank}] late.x: perseus_legacy: " in out, out
        assert re.search(rf'\[rank {rank}\] later\.y: perseus_legacy: cannot run allreduce '
                         rf'"later\.y": .*{named}', out), out


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_shutdown_from_a_done_callback_fails_the_others_and_init_starts_afresh(controller):
    out = run_ranks(2, "tests/workers/core_shutdown_in_callback.py", launcher=LAUNCHER,
                    timeout=120, controller=controller).stdout
    assert ('[rank 0] after the callback\'s shutdown: got the expected error: perseus_legacy: '
            'cannot run allreduce "cb.after": ') in out, out
    pending = re.search(r"\[rank 1\] pending on the other rank: got the expected error: (.*)", out)
    assert pending and "cb.pending" in pending.group(1), out
    assert re.search(r"rank 0 (shut down|\(127\.0\.0\.1:\d+\) closed)", pending.group(1)), out
    for rank in range(2):
        assert f"[rank {rank}] shutdown in a done callback OK" in out, out


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_killed_rank_ends_the_job_nonzero_within_30_seconds(controller):
    result = run_ranks(2, "tests/workers/core_killed.py", launcher=LAUNCHER, timeout=60,
                       expect_failure=True, controller=controller)
    ended = time.time()
    killed = re.search(r"KILLED_AT ([0-9.]+)", result.stdout)
    assert killed, result.stdout
    assert "UNEXPECTED" not in result.stdout, result.stdout
    assert ended - float(killed.group(1)) < 30, result.stdout
    assert_killed_rank_named(result.stdout, controller, survivor=0, killed=1)


def assert_killed_rank_named(out: str, controller: str, survivor: int, killed: int) -> None:
    """TCP: the survivor's own error names the killed rank (its closed connection), not only the
    launcher, which ends the job anyway. MPI: mpirun kills the survivors at once, before they can
    notice; its own report must name the killed rank and the signal."""
    if controller == "tcp":
        assert re.search(rf'RuntimeError: perseus_legacy: "never" failed: communication failed on '
                         rf'rank {survivor} .*rank {killed} \(127\.0\.0\.1:\d+\) closed its '
                         rf'connection \(the process exited or was killed\)', out), out
    else:
        assert re.search(rf"process rank {killed} with PID \d+ on node \S+ exited on\s+signal 9",
                         out), out


def test_init_again_after_shutdown_and_stall_shutdown(errors_run, request):
    assert "[rank 0] stall shutdown: got the expected error" in errors_run, errors_run
    # The second group itself, as each rank saw it: on MPI the sub-communicators {0, 2} and {1},
    # on TCP the same three ranks again.
    mpi = "[mpi]" in request.node.name
    for rank in range(3):
        size, sub_rank = ((2 if rank % 2 == 0 else 1), rank // 2) if mpi else (3, rank)
        total = (2 if rank % 2 == 0 else 1) if mpi else 3
        assert f"[rank {rank}] init again: rank {sub_rank} of {size}, sum [{total}, {total}]" \
            in errors_run, errors_run
