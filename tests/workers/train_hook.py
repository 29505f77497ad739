"""Runs on every rank: a plain optimizer plus SyncReplicasHook (or distribute_graph) trains like
single-process TensorFlow on the global batch.

The model, data and single-process reference are those of train_models.py (an embedding lookup
with a sparse tf.IndexedSlices gradient, then a dense layer). Ranks start from different random
values; the optimizer is NOT wrapped, so only the graph rewrite makes them train together.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy as pl

import functools
import sys

import tensorflow as tf
from train_models import (OPTIMIZERS, VAR_NAMES, assert_like_reference, build_model,
                          initial_values, monitored_session, reference, run_in_plain_session,
                          train_on_slices)
from worker_util import fail, run_cases


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

        model = (ids, targets, loss, global_step, variables)

        def run_steps(sess) -> list:
            return train_on_slices(sess, rank, size, what, model, train)

        if mode.startswith("hook"):
            hook = pl.SyncReplicasHook()
            with monitored_session([hook]) as sess:
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


# The case names, `<optimizer>_<mode>` (tests/test_sync_replicas_hook.py parametrizes over them).
CASES = ("sgd_hook", "sgd_session", "sgd_hook+distributed_optimizer",
         "momentum_hook", "momentum_session", "momentum_hook+distributed_optimizer",
         "adam_hook", "adam_session", "adam_hook+distributed_optimizer")


def train(rank: int, size: int, case: str) -> None:
    opt_name, mode = case.split("_", 1)
    got = distributed(opt_name, rank, size, mode)
    assert_like_reference(rank, f"{opt_name} {mode}", got, reference(opt_name))


def main() -> None:
    pl.init()
    rank, size = pl.rank(), pl.size()
    cases = {case: functools.partial(train, rank, size, case) for case in CASES}
    sys.exit(1 if run_cases(rank, cases, sys.argv[1:] or None) else 0)


if __name__ == "__main__":
    main()
