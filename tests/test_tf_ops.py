"""The TensorFlow collectives on real multi-rank launches, plus the op library's lazy loading.

One launch per configuration runs every named case of tests/workers/tf_collectives.py; each
case is a test of its own (`-k allgather_graph` launches only that case). The launches start
together, AT_ONCE at a time (harness.LaunchPool): each spends part of its time waiting on its
ranks' start and on the other ranks."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
from harness import ROOT, LaunchPool, launch_env, run_cases, selected_cases, worker_cases

WORKER = "tests/workers/tf_collectives.py"
CASES = worker_cases(WORKER)
# Plain mpirun must work as well as perseusrun: the runtime reads ranks from MPI itself. The
# TCP controller (perseusrun --tcp) carries the same ops.
LAUNCHES = [(1, "perseusrun", "mpi"), (2, "mpirun", "mpi"), (3, "perseusrun", "mpi"),
            (2, "perseusrun", "tcp")]


AT_ONCE = 2


def launch_id(launch: tuple) -> str:
    return "{}ranks-{}-{}".format(*launch)


def run_launch(launch: tuple, cases: list[str], work) -> object:
    np_, launcher, controller = launch
    return run_cases(np_, WORKER, cases, launcher=launcher, controller=controller, timeout=600)


@pytest.fixture(scope="module")
def launches(request) -> LaunchPool:
    """The launches of the selected cases, the widest first."""
    chosen = {launch: selected_cases(request, CASES, ("launch", launch)) for launch in
              sorted(LAUNCHES, key=lambda launch: -launch[0])}
    pool = LaunchPool("tf_ops_", {launch_id(launch): functools.partial(run_launch, launch, cases)
                                  for launch, cases in chosen.items() if cases}, at_once=AT_ONCE)
    yield pool
    pool.close()


@pytest.fixture(scope="module", params=LAUNCHES, ids=launch_id)
def launch(request, launches):
    return launches.result(launch_id(request.param))


@pytest.mark.parametrize("case", CASES)
def test_tf_collective_matches_numpy(launch, case):
    """Every op x dtype, uneven shapes, every broadcast root, shuffled build orders, 200 fused
    tensors, the gradients of each op, and the error paths (before init, mismatched shapes), in
    eager, tf.function and Session modes."""
    launch.check(case)


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=launch_env(),
                          capture_output=True, text=True, timeout=300)


def test_import_does_not_load_the_op_library_and_a_missing_build_is_an_import_error():
    code = (
        "import sysconfig\n"
        "import perseus_legacy as pl\n"
        "from perseus_legacy.tensorflow import collectives as ops\n"
        "assert ops._library is None, 'the op library was loaded at import'\n"
        "sysconfig.get_config_var = lambda name: '.not-built.so'\n"
        "try:\n"
        "    ops._op_library()\n"
        "except ImportError as exc:\n"
        "    assert 'was not built' in str(exc) and 'pip install' in str(exc), exc\n"
        "else:\n"
        "    raise SystemExit('no ImportError for a missing op library')\n"
        "print('lazy ok')\n"
    )
    proc = _python(code)
    assert proc.returncode == 0 and "lazy ok" in proc.stdout, proc.stdout + proc.stderr
