"""The native core (perseus_legacy._core) under real multi-rank launches, over both controllers.

Each launch runs one worker script on every rank. core_collectives.py's named cases are tests
of their own over one launch per rank count and controller (`-k alltoall` launches only that
case); the other workers check many things and exit non-zero, naming the rank and what failed.
Every test runs with the MPI controller (perseusrun) and with the TCP controller (perseusrun
--tcp, MPI never initialized). The launches are independent and wait on their ranks more than
they compute: a module fixture starts those of the selected tests together (harness.LaunchPool,
AT_ONCE at a time), and each test reads its own.
"""

from __future__ import annotations

import functools
import re
import time
from typing import Callable

import pytest
from harness import (
    CONTROLLERS,
    LaunchPool,
    run_cases,
    run_ranks,
    selected_cases,
    selected_tests,
    worker_cases,
)

LAUNCHER = "perseusrun"


COLLECTIVES_WORKER = "tests/workers/core_collectives.py"
COLLECTIVES_CASES = worker_cases(COLLECTIVES_WORKER)
COLLECTIVES_LAUNCHES = [(np_, controller) for controller in CONTROLLERS for np_ in (1, 2, 3, 4)]


@pytest.fixture(scope="module", params=COLLECTIVES_LAUNCHES, ids=lambda p: f"{p[0]}ranks-{p[1]}")
def collectives_launch(request, launches):
    """One launch per rank count and controller runs every selected case of the worker."""
    return launches.result(launch_name("collectives_launch", request.param))


def collectives(np_: int, controller: str, cases: list[str]):
    return run_cases(np_, COLLECTIVES_WORKER, cases, launcher=LAUNCHER, timeout=240,
                     controller=controller)


@pytest.mark.parametrize("case", COLLECTIVES_CASES)
def test_collective_matches_numpy_for_every_dtype_op_and_submission_order(
        collectives_launch, case):
    """Every dtype and op, scale factors, outputs given or in place, negative values, uneven
    allgather and alltoall, every broadcast root, empty tensors, shuffled submission from
    threads, fusion (small and large tensors), argument errors, the single-rank shortcut, and
    the calls before init and after shutdown."""
    collectives_launch.check(case)


@pytest.fixture(scope="module", params=CONTROLLERS)
def errors_run(request, launches):
    return launches.result(launch_name("errors_run", request.param))


def errors(controller: str) -> str:
    return run_ranks(3, "tests/workers/core_errors.py", launcher=LAUNCHER, timeout=240,
                     env={"PERSEUS_STALL_WARNING_SECS": "1"}, controller=controller).stdout


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


def leaving_early(controller: str) -> str:
    return run_ranks(3, "tests/workers/core_shutdown_early.py", launcher=LAUNCHER,
                     timeout=180, controller=controller).stdout


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_rank_leaving_early_fails_the_others_pending_ops_naming_it(launch, controller):
    out = launch()
    # Over TCP, rank 1's closed connection may be noticed before its goodbye is read: the
    # error then says so, naming rank 1 and its address.
    named = r"rank 1 (shut down|\(127\.0\.0\.1:\d+\) closed its connection)"
    for rank in (0, 2):
        assert f"[rank {rank}] late.x: perseus_legacy: " in out, out
        assert re.search(rf'\[rank {rank}\] later\.y: perseus_legacy: cannot run allreduce '
                         rf'"later\.y": .*{named}', out), out


def shutdown_in_callback(controller: str) -> str:
    return run_ranks(2, "tests/workers/core_shutdown_in_callback.py", launcher=LAUNCHER,
                     timeout=120, controller=controller).stdout


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_shutdown_from_a_done_callback_fails_the_others_and_init_starts_afresh(launch,
                                                                             controller):
    out = launch()
    assert ('[rank 0] after the callback\'s shutdown: got the expected error: perseus_legacy: '
            'cannot run allreduce "cb.after": ') in out, out
    pending = re.search(r"\[rank 1\] pending on the other rank: got the expected error: (.*)", out)
    assert pending and "cb.pending" in pending.group(1), out
    assert re.search(r"rank 0 (shut down|\(127\.0\.0\.1:\d+\) closed)", pending.group(1)), out
    for rank in range(2):
        assert f"[rank {rank}] shutdown in a done callback OK" in out, out


def killed(controller: str) -> tuple:
    """The ended launch, and when it ended."""
    result = run_ranks(2, "tests/workers/core_killed.py", launcher=LAUNCHER, timeout=60,
                       expect_failure=True, controller=controller)
    return result, time.time()


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_killed_rank_ends_the_job_nonzero_within_30_seconds(launch, controller):
    result, ended = launch()
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


# ---- the launches of the selected tests, started together ------------------------------------

AT_ONCE = 2  # the other module the suite runs beside it keeps its timing bounds
# The launches the tests read by their name (each takes the controller); the collectives'
# launches take their rank count and cases too. Ranks: the pool starts the widest first.
SINGLE_LAUNCHES: dict[str, tuple[int, Callable]] = {
    "errors_run": (3, errors),
    "test_rank_leaving_early_fails_the_others_pending_ops_naming_it": (3, leaving_early),
    "test_shutdown_from_a_done_callback_fails_the_others_and_init_starts_afresh": (
        2, shutdown_in_callback),
    "test_killed_rank_ends_the_job_nonzero_within_30_seconds": (2, killed),
}


def launch_name(what: str, param) -> str:
    return f"{what}[{'-'.join(map(str, param)) if isinstance(param, tuple) else param}]"


def launch_of(item: pytest.Item) -> tuple[str, object] | None:
    """(what, parameter): the launch a test reads (None: it reads none)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    for fixture in ("collectives_launch", "errors_run"):
        if fixture in params:
            return fixture, params[fixture]
    if item.originalname in SINGLE_LAUNCHES:
        return item.originalname, params["controller"]
    return None


@pytest.fixture(scope="module")
def launches(request) -> LaunchPool:
    """The launches of the selected tests (`-k` starts only theirs), the widest first."""
    chosen: dict[str, tuple[int, Callable]] = {}
    for item in selected_tests(request):
        if launch_of(item) is None or launch_name(*launch_of(item)) in chosen:
            continue
        what, param = launch_of(item)
        if what == "collectives_launch":
            cases = selected_cases(request, COLLECTIVES_CASES, (what, param))
            ranks, run = param[0], functools.partial(collectives, *param, cases)
        else:
            ranks, single = SINGLE_LAUNCHES[what]
            run = functools.partial(single, param)
        chosen[launch_name(what, param)] = ranks, run
    order = sorted(chosen, key=lambda name: -chosen[name][0])
    pool = LaunchPool("core_collectives_", {name: (lambda work, run=chosen[name][1]: run())
                                            for name in order}, at_once=AT_ONCE)
    yield pool
    pool.close()


@pytest.fixture
def launch(launches, request) -> Callable[[], object]:
    """This test's launch: calling it waits for its result (or raises what the launch raised)."""
    return functools.partial(launches.result, launch_name(*launch_of(request.node)))
