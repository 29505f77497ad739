"""Runs on every rank: SyncReplicasOptimizer and DistributedOptimizer(backward_passes_per_step)
train like single-process TensorFlow taking one step per group of global batches.

Model, data and initial values are those of train_models.py. With k passes per update, every
update must equal one single-process step on the k global batches concatenated (the mean of the
k x size equal-sized local means is the mean over all their rows); DistributedOptimizer sums the
k passes by default (Horovod's rule), which is that step on k times the loss.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy as pl

import numpy as np
import tensorflow as tf
from train_models import (ATOL, CONFIG, OPTIMIZERS, RTOL, VAR_NAMES, build_model, global_batch,
                          initial_values, local_batch)
from worker_util import assert_close, fail

UPDATES = 3


def reference(opt_name: str, passes: int, loss_scale: float) -> list:
    """Single process, plain TensorFlow: one step per `passes` global batches concatenated."""
    with tf.Graph().as_default():
        ids, targets, loss, global_step, variables = build_model(initial_values(0))
        train = OPTIMIZERS[opt_name]().minimize(loss * loss_scale, global_step=global_step)
        with tf.compat.v1.Session(config=CONFIG) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for update in range(UPDATES):
                batches = [global_batch(update * passes + p) for p in range(passes)]
                sess.run(train, {ids: np.concatenate([b[0] for b in batches]),
                                 targets: np.concatenate([b[1] for b in batches])})
            return sess.run(variables)


def distributed(opt_name: str, rank: int, size: int, mode: str, passes: int) -> list:
    """Trains UPDATES x passes runs of the train op on this rank's slices; final values."""
    with tf.Graph().as_default():
        ids, targets, loss, global_step, variables = build_model(initial_values(rank), 7 * rank)
        if mode == "sync_replicas":
            opt = pl.SyncReplicasOptimizer(OPTIMIZERS[opt_name](),
                                           replicas_to_aggregate=passes * size)
        else:
            opt = pl.DistributedOptimizer(OPTIMIZERS[opt_name](), backward_passes_per_step=passes)
        train = opt.minimize(loss, global_step=global_step)
        what = f"{opt_name} {mode} x{passes}"

        def run_steps(sess) -> list:
            for update in range(UPDATES):
                for p in range(passes):
                    got = sess.run(global_step)
                    if got != update:
                        fail(rank, f"{what}: global step {got} before pass {p} of update "
                                   f"{update}: it must advance once per {passes} passes")
                    batch_ids, batch_targets = local_batch(update * passes + p, rank, size)
                    sess.run(train, {ids: batch_ids, targets: batch_targets})
            final = sess.run(variables + [global_step])
            assert_close(rank, f"{what}: global step", final[-1], np.int64(UPDATES))
            return final[:-1]

        if mode == "sync_replicas":
            hook = opt.make_session_run_hook(pl.is_chief())
            with tf.compat.v1.train.MonitoredTrainingSession(
                    hooks=[hook], config=CONFIG, log_step_count_steps=None,
                    save_summaries_steps=None, save_checkpoint_secs=None) as sess:
                return run_steps(sess)
        with tf.compat.v1.Session(config=CONFIG) as sess:
            sess.run([tf.compat.v1.global_variables_initializer(),
                      tf.compat.v1.local_variables_initializer()])
            sess.run(pl.broadcast_global_variables(0))
            return run_steps(sess)


def check_refused(rank: int, size: int) -> None:
    sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    cases = {"backup workers": dict(replicas_to_aggregate=size - 1),
             "not a multiple": dict(replicas_to_aggregate=2 * size + 1),
             "total_num_replicas": dict(total_num_replicas=size + 1)}
    for needle, kwargs in cases.items():
        try:
            pl.SyncReplicasOptimizer(sgd, **kwargs)
        except ValueError as exc:
            if needle not in str(exc) or f"rank {rank}" not in str(exc):
                fail(rank, f"SyncReplicasOptimizer({kwargs}): unclear error {exc}")
        else:
            fail(rank, f"SyncReplicasOptimizer({kwargs}) was accepted")


def main() -> None:
    pl.init()
    rank, size = pl.rank(), pl.size()
    check_refused(rank, size)
    for opt_name in OPTIMIZERS:
        for mode, passes, loss_scale in (("sync_replicas", 1, 1.0), ("sync_replicas", 2, 1.0),
                                         ("distributed_optimizer", 2, 2.0)):
            expected = reference(opt_name, passes, loss_scale)
            got = distributed(opt_name, rank, size, mode, passes)
            for name, g, e in zip(VAR_NAMES, got, expected):
                assert_close(rank, f"{opt_name} {mode} x{passes}: {name}", g, e, rtol=RTOL,
                             atol=ATOL)
    print(f"[rank {rank}] OK: SyncReplicasOptimizer x1/x2, DistributedOptimizer x2, "
          "sgd/momentum/adam; refused settings", flush=True)


if __name__ == "__main__":
    main()
