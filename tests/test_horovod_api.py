"""Horovod's TensorFlow API on real ranks: the names a Horovod program uses, against numpy or a
one-process run (tests/workers/hvd_api.py, tests/workers/hvd_keras.py)."""

from __future__ import annotations

import pytest
from harness import run_ranks


@pytest.mark.parametrize("np_, controller", [(2, "mpi"), (3, "mpi"), (2, "tcp")])
def test_horovod_api_matches_numpy_and_one_process_training(np_, controller):
    """reducescatter (uneven rows, scale factors, gradients), grouped_allgather, broadcast_,
    object collectives, *_op queries, *_built flags, IndexedSlices rules, deprecated average=,
    TF1 predivision, DistributedGradientTape (tf.function step equals one process on the global
    batch), PartialDistributedGradientTape and SyncBatchNormalization (uneven batches)."""
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
    from estimator.tf_matrix import python_for

    cases = ("sgd:graph", "legacy_adam:eager")
    # The TF 2.15 environment has no MPI: the ranks meet over the TCP controller.
    out = run_ranks(2, "tests/workers/keras_fit.py", *cases, timeout=400, controller="tcp",
                    python=python_for("tf215")).stdout
    for case in cases:
        assert f"{case}: same weights as single-process fit on the global batch" in out, out
