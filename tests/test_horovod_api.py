"""Horovod's TensorFlow API on real ranks: the names a Horovod program uses, against numpy or a
one-process run (tests/workers/hvd_*.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import ROOT, WORKERS, finish, python_for, rank_env, run_ranks

from perseusrun import tcp_run


@pytest.mark.parametrize("np_, controller", [(2, "mpi"), (3, "mpi"), (2, "tcp")])
def test_horovod_api_matches_numpy_and_one_process_training(np_, controller):
    """reducescatter (uneven rows, scale factors, gradients), grouped_allgather, broadcast_,
    object collectives, *_op queries, *_built flags, IndexedSlices rules, deprecated average=,
    TF1 predivision and register_local_var (scaled or not, 1 and 2 passes), a Keras optimizer
    given to perseus_legacy.DistributedOptimizer, is_homogeneous on one host,
    DistributedGradientTape (tf.function step equals one process on the global batch),
    PartialDistributedGradientTape and SyncBatchNormalization (uneven batches)."""
    out = run_ranks(np_, "tests/workers/hvd_api.py", timeout=500, controller=controller,
                    env={"PERSEUS_EXPECT_CONTROLLER": controller}).stdout
    assert out.count("] OK") == np_, out


def test_keras_horovod_arguments_and_callbacks(tmp_path):
    """backward_passes_per_step=2 (averaged or summed) equals single-process fit on the global
    batch, graph and eager; local layers stay per rank; staircase schedule; best checkpoint on
    rank 0 only."""
    out = run_ranks(2, "tests/workers/hvd_keras.py", tmp_path, timeout=400).stdout
    assert out.count("] OK") == 2, out
    for average, mode in (("True", "graph"), ("True", "eager"), ("False", "graph")):
        assert (f"backward_passes_per_step=2 average={average} {mode}: same weights as "
                "single-process fit on the global batch") in out, out


def test_keras_on_tf_2_15_accepts_tf_keras_optimizers_and_fits_like_one_process():
    """TensorFlow 2.15.1 without tf-keras: perseus_legacy.keras imports, and tf.keras (Keras
    2.15) optimizers, new and legacy, train on 2 ranks like one process on the global batch."""
    cases = ("sgd:graph", "legacy_adam:eager")
    # The TF 2.15 environment has no MPI: the ranks meet over the TCP controller.
    out = run_ranks(2, "tests/workers/keras_fit.py", *cases, timeout=400, controller="tcp",
                    python=python_for("tf215")).stdout
    for case in cases:
        assert f"{case}: same weights as single-process fit on the global batch" in out, out


def test_adasum_matches_a_numpy_tree_of_every_ranks_tensors_on_4_ranks():
    """allreduce/grouped_allreduce (float16/32/64, zero, orthogonal, parallel, scale factors,
    fp16, a process set of 2) equal the numpy tree and are bitwise the same on every rank;
    DistributedGradientTape and the Keras optimizer combine gradients, the TF1 optimizer the
    changes of 1 and 2 local steps; sparse, integer, 3-rank and gradient uses fail clearly."""
    out = run_ranks(4, "tests/workers/hvd_adasum.py", timeout=500).stdout
    assert out.count("] OK") == 4, out


def test_elastic_programs_run_unchanged_on_a_fixed_set_of_ranks():
    """A custom loop with TensorFlowKerasState, Model.fit with KerasState and its callbacks, a
    TF1 Session with TensorFlowState: ranks that start apart get rank 0's state, train like one
    process on the global batch, and restore() drops what was not committed."""
    out = run_ranks(2, "tests/workers/hvd_elastic.py", timeout=400).stdout
    assert out.count("] OK") == 2, out


def test_adasum_elastic_and_local_variables_on_tf_2_15():
    """TensorFlow 2.15.1 (tf.keras is Keras 2.15, no MPI: the TCP controller): the Adasum and
    elastic workers and the new hvd_api checks, on 2 ranks."""
    out = run_ranks(2, "tests/workers/hvd_checks.py", "hvd_adasum", "hvd_elastic",
                    "hvd_api:check_tf1_local_variables,check_keras_optimizer_forwarding,"
                    "check_homogeneous", timeout=600, controller="tcp",
                    python=python_for("tf215")).stdout
    assert out.count("] OK") == 2, out


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
