"""tf.summary in a model_fn, on TF 2.21 (which no longer installs TensorBoard: perseus_legacy
depends on it), with run_config() on 2 ranks: rank 0's event file holds the scalar the model_fn
logged at every step, equal to the loss numpy computes for rank 0's batch of that step after
the steps before it on the global batch; rank 1 writes no event file anywhere.
"""

from __future__ import annotations

import json

import numpy as np
from harness import run_ranks, worker_module

WORKER = "tests/workers/est_summary.py"
RTOL, ATOL = 1e-5, 1e-6  # float32 sums in another order


def losses_of_rank_0(worker) -> dict:
    """step -> the loss rank 0 computes at that step (the summary of step s is taken in the run
    that makes step s, before its update), in float64 numpy; SGD on the global batch's mean
    squared error, as synchronous training on every rank's slice of it."""
    x, y = (a.astype(np.float64) for a in worker.global_batches())
    rows = worker.local_rows(0, 2)
    w = worker.initial_weights().astype(np.float64)
    losses = {}
    for step in range(worker.STEPS):
        losses[step + 1] = float(np.mean((x[step, rows] @ w - y[step, rows]) ** 2))
        error = x[step] @ w - y[step]
        w = w - worker.LEARNING_RATE * 2 * x[step].T @ error / len(error)
    return losses


def scalars(tf, path) -> dict:
    """tag -> {step: value} of the scalars in one event file."""
    found: dict = {}
    for event in tf.compat.v1.train.summary_iterator(str(path)):
        for value in event.summary.value:
            found.setdefault(value.tag, {})[event.step] = value.simple_value
    return found


def test_tf_summary_in_a_model_fn_is_written_by_rank_0_only_with_the_numpy_losses(tmp_path):
    import perseus_legacy  # noqa: F401, I001 (first: it brings tf.estimator back)
    import tensorflow as tf

    worker = worker_module("est_summary")
    run_ranks(2, WORKER, tmp_path, timeout=300)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    model_dir = tmp_path / "fs_of_rank0" / "model"
    assert records[0]["model_dir"] == str(model_dir), records[0]
    events = [f for f in records[0]["model_dir_files"] if f.startswith("events.out.tfevents")]
    assert len(events) == 1, records[0]
    logged = scalars(tf, model_dir / events[0])
    expected = losses_of_rank_0(worker)
    assert sorted(logged.get(worker.TAG, {})) == sorted(expected), logged
    for step, loss in expected.items():
        np.testing.assert_allclose(logged[worker.TAG][step], loss, rtol=RTOL, atol=ATOL,
                                   err_msg=f"{worker.TAG} at step {step}")
        # The Estimator's own loss summary is the same tensor.
        assert logged["loss"][step] == logged[worker.TAG][step], (step, logged)

    assert records[1]["model_dir"] != str(tmp_path / "fs_of_rank1" / "model"), records[1]
    assert records[1]["view_files"] == [], records[1]  # nothing where rank 1 was told to write
    assert not [f for f in records[1]["model_dir_files"] if "tfevents" in f], records[1]
