"""Runs on every rank: a plain optimizer plus SyncReplicasHook (or distribute_graph) trains like
single-process TensorFlow on the global batch.

The model, data and single-process reference are those of train_models.py (an embedding lookup
with a sparse tf.IndexedSlices gradient, then a dense layer). Ranks start from different random
values; the optimizer is NOT wrapped, so only the graph rewrite makes them train together.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy as pl

import numpy as np
import tensorflow as tf
from train_models import (ATOL, CONFIG, OPTIMIZERS, RTOL, STEPS, VAR_NAMES, build_model,
                          initial_values, local_batch, reference, run_in_plain_session)
from worker_util import assert_close, fail

MODES = ("hook", "session", "hook+distributed_optimizer")


def collectives(graph: tf.Graph) -> list:
    """The gradient collectives (the broadcasts left out)."""
    return [op.name for op in graph.get_operations()
            if op.type in ("PerseusAllreduce", "PerseusAllgather")]


def distributed(opt_name: str, rank: int, size: int, mode: str) -> list:
    """Trains STEPS steps on this rank's slices; returns the final variable values."""
    with tf.Graph().as_default() as graph:
        ids, targets, loss, global_step, variables = build_model(initial_values(rank), 7 * rank)
        opt = OPTIMIZERS[opt_name]()
        if mode == "hook+distributed_optimizer":
            opt = pl.DistributedOptimizer(opt)
        train = opt.minimize(loss, global_step=global_step)
        before = collectives(graph)
        if mode != "hook+distributed_optimizer" and before:
            fail(rank, f"{opt_name} {mode}: collectives before the rewrite: {before}")
        what = f"{opt_name} {mode}"

        def run_steps(sess) -> list:
            start = sess.run(variables + [global_step])
            wanted = [initial_values(0)[n] for n in VAR_NAMES] + [np.int64(0)]
            for name, got, want in zip(VAR_NAMES + ("global_step",), start, wanted):
                assert_close(rank, f"{what}: {name} after the broadcast", got, want, rtol=0.0)
            for step in range(STEPS):
                batch_ids, batch_targets = local_batch(step, rank, size)
                sess.run(train, {ids: batch_ids, targets: batch_targets})
            final = sess.run(variables + [global_step])
            assert_close(rank, f"{what}: global step", final[-1], np.int64(STEPS))
            return final[:-1]

        if mode.startswith("hook"):
            hook = pl.SyncReplicasHook()
            with tf.compat.v1.train.MonitoredTrainingSession(
                    hooks=[hook], config=CONFIG, log_step_count_steps=None,
                    save_summaries_steps=None, save_checkpoint_secs=None) as sess:
                # One gradient per variable (kernel, bias dense; embedding sparse), or none
                # when DistributedOptimizer already averages them.
                want = 0 if mode == "hook+distributed_optimizer" else len(VAR_NAMES)
                if hook.rewritten != want:
                    fail(rank, f"{what}: the hook rewrote {hook.rewritten} ops, expected {want}")
                if mode == "hook+distributed_optimizer" and collectives(graph) != before:
                    fail(rank, f"{what}: the hook added collectives to a DistributedOptimizer "
                               f"graph: {sorted(set(collectives(graph)) - set(before))}")
                return run_steps(sess)
        count = pl.distribute_graph()
        if count != len(VAR_NAMES):
            fail(rank, f"{what}: distribute_graph() returned {count}, expected {len(VAR_NAMES)}")
        after = collectives(graph)
        again = pl.distribute_graph()
        if again != 0 or collectives(graph) != after:
            fail(rank, f"{what}: a second distribute_graph() rewrote {again} more ops")
        gathers = [n for n in after if "update_embedding" in n]
        if len(gathers) != 2:  # the embedding's gradient values and indices
            fail(rank, f"{what}: expected 2 allgathers for the sparse gradient, got {gathers}")
        return run_in_plain_session(run_steps)


def main() -> None:
    pl.init()
    rank, size = pl.rank(), pl.size()
    for opt_name in OPTIMIZERS:
        expected = reference(opt_name)
        for mode in MODES:
            got = distributed(opt_name, rank, size, mode)
            for name, g, e in zip(VAR_NAMES, got, expected):
                assert_close(rank, f"{opt_name} {mode}: {name}", g, e, rtol=RTOL, atol=ATOL)
    print(f"[rank {rank}] OK: sgd/momentum/adam x ({', '.join(MODES)})", flush=True)


if __name__ == "__main__":
    main()
