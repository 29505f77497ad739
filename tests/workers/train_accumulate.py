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

import functools
import sys

import numpy as np
import tensorflow as tf
from train_models import (OPTIMIZERS, assert_like_reference, build_model, initial_values,
                          local_batch, monitored_session, reference, run_in_plain_session)
from worker_util import assert_close, fail, run_cases

UPDATES = 3


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
            with monitored_session([opt.make_session_run_hook(pl.is_chief())]) as sess:
                return run_steps(sess)
        return run_in_plain_session(run_steps)


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


# The case names, `<optimizer>_<mode>_x<passes>` and the refused settings (tests/test_training.py
# parametrizes over them). DistributedOptimizer sums its passes: one step on passes x the loss.
CASES = ("sgd_sync_replicas_x1", "sgd_sync_replicas_x2", "sgd_distributed_optimizer_x2",
         "momentum_sync_replicas_x1", "momentum_sync_replicas_x2",
         "momentum_distributed_optimizer_x2", "adam_sync_replicas_x1", "adam_sync_replicas_x2",
         "adam_distributed_optimizer_x2", "refused_settings")


def train(rank: int, size: int, case: str) -> None:
    opt_name, rest = case.split("_", 1)
    mode, passes = rest.rsplit("_x", 1)
    passes = int(passes)
    loss_scale = float(passes) if mode == "distributed_optimizer" else 1.0
    got = distributed(opt_name, rank, size, mode, passes)
    assert_like_reference(rank, f"{opt_name} {mode} x{passes}", got,
                          reference(opt_name, UPDATES, passes, loss_scale))


def main() -> None:
    pl.init()
    rank, size = pl.rank(), pl.size()
    cases = {case: functools.partial(train, rank, size, case) for case in CASES}
    cases["refused_settings"] = lambda: check_refused(rank, size)
    sys.exit(1 if run_cases(rank, cases, sys.argv[1:] or None) else 0)


if __name__ == "__main__":
    main()
