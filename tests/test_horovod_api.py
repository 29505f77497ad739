"""Horovod's TensorFlow API on real ranks: the names a Horovod program uses, against numpy or a
one-process run (tests/workers/hvd_*.py).

The named cases of hvd_api, hvd_adasum, hvd_elastic and hvd_keras run through hvd_checks.py, one
launch per configuration (LAUNCHES) for every test that names it: each case is a test of its own
and `-k` launches only what it selects. Those launches start together, AT_ONCE at a time
(harness.LaunchPool)."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
from harness import (
    ROOT,
    WORKERS,
    LaunchPool,
    finish,
    python_for,
    rank_env,
    run_cases,
    run_ranks,
    selected_cases,
    worker_cases,
)

from perseusrun import tcp_run

CHECKS_WORKER = "tests/workers/hvd_checks.py"


def cases_of(worker: str, names: tuple = ()) -> list[str]:
    """The named cases `worker.case` of tests/workers/<worker>.py (hvd_checks.py runs them)."""
    return [f"{worker}.{case}" for case in names or worker_cases(f"tests/workers/{worker}.py")]


API, ADASUM, ELASTIC = cases_of("hvd_api"), cases_of("hvd_adasum"), cases_of("hvd_elastic")
KERAS = cases_of("hvd_keras")
# TensorFlow 2.15.1 (tf.keras is Keras 2.15; no MPI there: the TCP controller).
TF215_API = cases_of("hvd_api", ("tf1_local_variables", "keras_optimizer_forwarding",
                                 "homogeneous"))
# One launch each (TensorFlow's start-up dominates): ranks, controller, TensorFlow, timeout and
# the cases it runs; the tests below take the cases of a worker from the launches named.
LAUNCHES = {
    "2ranks-mpi": (2, "mpi", "main", 800, API + ELASTIC + KERAS),
    "3ranks-mpi": (3, "mpi", "main", 500, API),
    "2ranks-tcp": (2, "tcp", "main", 500, API),
    "4ranks-mpi": (4, "mpi", "main", 500, ADASUM),  # Adasum: a power of 2 of ranks
    "tf215-2ranks-tcp": (2, "tcp", "tf215", 600, ADASUM + ELASTIC + TF215_API),
}


AT_ONCE = 2


def run_launch(name: str, cases: list[str], work: Path):
    ranks, controller, version, timeout, _ = LAUNCHES[name]
    return run_cases(ranks, CHECKS_WORKER, cases, timeout=timeout, controller=controller,
                     python=python_for(version), env={"PERSEUS_EXPECT_CONTROLLER": controller})


@pytest.fixture(scope="module")
def hvd_launches(request) -> LaunchPool:
    """Every launch of LAUNCHES that a selected test names, the widest first, running the cases
    the selected tests ask of it."""
    chosen = {name: selected_cases(request, LAUNCHES[name][4], ("hvd_launch", name))
              for name in sorted(LAUNCHES, key=lambda name: -LAUNCHES[name][0])}
    pool = LaunchPool("horovod_api_", {name: functools.partial(run_launch, name, cases)
                                       for name, cases in chosen.items() if cases},
                      at_once=AT_ONCE)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def hvd_launch(request, hvd_launches):
    """The launch LAUNCHES[request.param] (a test's indirect parameter), once for the module."""
    return hvd_launches.result(request.param)


@pytest.mark.parametrize("case", API)
@pytest.mark.parametrize("hvd_launch", ["2ranks-mpi", "3ranks-mpi", "2ranks-tcp"], indirect=True)
def test_horovod_api_matches_numpy_and_one_process_training(hvd_launch, case):
    """reducescatter (uneven rows, scale factors, gradients), grouped_allgather, broadcast_,
    object collectives, *_op queries, *_built flags, IndexedSlices rules, deprecated average=,
    TF1 predivision and register_local_var (scaled or not, 1 and 2 passes), a Keras optimizer
    given to perseus_legacy.DistributedOptimizer, is_homogeneous on one host,
    DistributedGradientTape (tf.function step equals one process on the global batch),
    PartialDistributedGradientTape and SyncBatchNormalization (uneven batches)."""
    hvd_launch.check(case)


@pytest.mark.parametrize("case", TF215_API)
@pytest.mark.parametrize("hvd_launch", ["tf215-2ranks-tcp"], indirect=True)
def test_local_variables_keras_optimizers_and_homogeneous_on_tf_2_15(hvd_launch, case):
    """TensorFlow 2.15.1 without tf-keras: TF1 register_local_var, a tf.keras (Keras 2.15)
    optimizer given to perseus_legacy.DistributedOptimizer, is_homogeneous."""
    hvd_launch.check(case)


@pytest.mark.parametrize("case", KERAS)
@pytest.mark.parametrize("hvd_launch", ["2ranks-mpi"], indirect=True)
def test_keras_horovod_arguments_and_callbacks(hvd_launch, case):
    """backward_passes_per_step=2 (averaged or summed) equals single-process fit on the global
    batch, graph and eager; local layers stay per rank; staircase schedule; best checkpoint on
    rank 0 only."""
    hvd_launch.check(case)


def test_keras_on_tf_2_15_accepts_tf_keras_optimizers_and_fits_like_one_process():
    """TensorFlow 2.15.1 without tf-keras: perseus_legacy.keras imports, and tf.keras (Keras
    2.15) optimizers, new and legacy, train on 2 ranks like one process on the global batch."""
    cases = ("sgd:graph", "legacy_adam:eager")
    # The TF 2.15 environment has no MPI: the ranks meet over the TCP controller.
    out = run_ranks(2, "tests/workers/keras_fit.py", *cases, timeout=400, controller="tcp",
                    python=python_for("tf215")).stdout
    for case in cases:
        assert f"{case}: same weights as single-process fit on the global batch" in out, out


@pytest.mark.parametrize("case", ADASUM)
@pytest.mark.parametrize("hvd_launch", ["4ranks-mpi", "tf215-2ranks-tcp"], indirect=True)
def test_adasum_matches_a_numpy_tree_of_every_ranks_tensors(hvd_launch, case):
    """allreduce/grouped_allreduce (float16/32/64, zero, orthogonal, parallel, scale factors,
    fp16, a process set of 2) equal the numpy tree and are bitwise the same on every rank;
    DistributedGradientTape and the Keras optimizer combine gradients, the TF1 optimizer the
    changes of 1 and 2 local steps; sparse, integer, 3-rank and gradient uses fail clearly. On
    4 ranks, and on 2 ranks under TensorFlow 2.15.1."""
    hvd_launch.check(case)


@pytest.mark.parametrize("case", ELASTIC)
@pytest.mark.parametrize("hvd_launch", ["2ranks-mpi", "tf215-2ranks-tcp"], indirect=True)
def test_elastic_programs_run_unchanged_on_a_fixed_set_of_ranks(hvd_launch, case):
    """A custom loop with TensorFlowKerasState, Model.fit with KerasState and its callbacks, a
    TF1 Session with TensorFlowState: ranks that start apart get rank 0's state, train like one
    process on the global batch, and restore() drops what was not committed. Under the
    project's TensorFlow and TensorFlow 2.15.1."""
    hvd_launch.check(case)


def test_is_homogeneous_is_false_for_2_plus_1_hosts_and_adasum_refuses_3_ranks():
    """Three ranks started by hand over TCP, two at 127.0.0.1 and one at 127.0.0.2 (two hosts
    by their addresses): every rank answers is_homogeneous() False, and Adasum names the 3."""
    ports = tcp_run.free_local_ports(3)
    addresses = [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}", f"127.0.0.2:{ports[2]}"]
    procs = [subprocess.Popen([sys.executable, str(WORKERS / "hvd_uneven_hosts.py")], cwd=ROOT,
                              env=rank_env(rank, addresses), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for rank in range(3)]
    results = finish(procs, timeout=150)
    everything = "\n".join(out for _, out in results)
    for rank, (code, out) in enumerate(results):
        assert code == 0 and f"[rank {rank}] OK" in out, everything
