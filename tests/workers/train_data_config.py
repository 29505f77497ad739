"""Runs on every rank: data.shard gives each rank its elements; config helpers; eager paths.

Expected values come from the rank and size alone: elements index::count of range(N).
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy as pl
from perseus_legacy.tf1 import data

import numpy as np
import tensorflow as tf
from worker_util import fail

N = 20


def elements(dataset: tf.data.Dataset) -> list:
    return [int(x) for x in dataset.as_numpy_iterator()]


def all_ranks_elements(mine: list, size: int) -> list:
    """Every rank's elements, gathered (padded to equal length with -1)."""
    padded = np.full(N, -1, np.int64)
    padded[:len(mine)] = mine
    gathered = pl.allgather(tf.constant(padded[None]), name="shard_elements").numpy()
    return [[int(x) for x in row if x >= 0] for row in gathered]


def check_shard(rank: int, size: int) -> None:
    mine = elements(data.shard(tf.data.Dataset.range(N)))
    if mine != list(range(rank, N, size)):
        fail(rank, f"shard(range({N})) gave {mine}, expected {list(range(rank, N, size))}")
    everyone = all_ranks_elements(mine, size)
    if sorted(sum(everyone, [])) != list(range(N)):
        fail(rank, f"the shards do not partition range({N}): {everyone}")
    # Shard, then shuffle, then repeat: the recommended order is accepted.
    ok = data.shard(tf.data.Dataset.range(N)).shuffle(8).repeat(2)
    if sorted(elements(ok)) != sorted(2 * list(range(rank, N, size))):
        fail(rank, "shard -> shuffle -> repeat lost or added elements")
    # An input_fn wrapped for training.
    fn = data.sharded_input_fn(lambda: tf.data.Dataset.range(N).batch(1))
    got = [int(b[0]) for b in fn().as_numpy_iterator()]
    if got != list(range(rank * 1, N, size)):
        fail(rank, f"sharded_input_fn gave {got}")
    for what, dataset in [("shuffle", tf.data.Dataset.range(N).shuffle(4)),
                          ("repeat", tf.data.Dataset.range(N).repeat(2).map(lambda x: x + 1))]:
        try:
            data.shard(dataset)
        except ValueError as exc:
            if "allow_after_shuffle" not in str(exc) or what not in str(exc):
                fail(rank, f"shard after {what}: unhelpful message {exc}")
        else:
            fail(rank, f"shard after {what} raised no ValueError")
    seeded = tf.data.Dataset.range(N).shuffle(N, seed=3, reshuffle_each_iteration=False)
    got = elements(data.shard(seeded, allow_after_shuffle=True))
    expected = elements(seeded)[rank::size]
    if got != expected:
        fail(rank, f"allow_after_shuffle shard gave {got}, expected {expected}")


def check_config(rank: int, size: int) -> None:
    user = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                    inter_op_parallelism_threads=2)
    config = pl.session_config(user)
    if config.gpu_options.visible_device_list != str(rank):  # one host: local rank == rank
        fail(rank, f"visible_device_list {config.gpu_options.visible_device_list!r}")
    if not config.gpu_options.allow_growth:
        fail(rank, "allow_growth not set")
    if (config.intra_op_parallelism_threads, config.inter_op_parallelism_threads) != (1, 2):
        fail(rank, "session_config dropped the user's thread settings")
    # More than one rank: TensorFlow's pools must not spin on the cores the collectives need.
    if not config.experimental.disable_thread_spinning:
        fail(rank, "session_config left thread spinning on with more than one rank")
    if pl.session_config(user, thread_spinning=True).experimental.disable_thread_spinning:
        fail(rank, "session_config(thread_spinning=True) still disabled spinning")
    if user.experimental.disable_thread_spinning:
        fail(rank, "session_config modified its argument's experimental options")
    if user.gpu_options.visible_device_list:
        fail(rank, "session_config modified its argument")
    if pl.session_config().gpu_options.visible_device_list != str(rank):
        fail(rank, "session_config() without an argument")
    if pl.is_chief() != (rank == 0):
        fail(rank, f"is_chief() is {pl.is_chief()}")
    want_dir = "/some/dir" if rank == 0 else None
    if pl.checkpoint_dir("/some/dir") != want_dir:
        fail(rank, f"checkpoint_dir gave {pl.checkpoint_dir('/some/dir')!r}")
    if abs(pl.scale_learning_rate(0.1) - 0.1 * size) > 1e-12:
        fail(rank, f"scale_learning_rate(0.1) is {pl.scale_learning_rate(0.1)}")
    cases = {10: 10 // size, 1: 1, size - 1: 1, None: None}
    for steps, want in cases.items():
        if pl.scale_steps(steps) != want:
            fail(rank, f"scale_steps({steps}) is {pl.scale_steps(steps)}, expected {want}")


def check_eager(rank: int, size: int) -> None:
    var = tf.Variable([float(rank + 5)])
    pl.broadcast_variables([var], 0)
    if var.numpy().tolist() != [5.0]:
        fail(rank, f"eager broadcast_variables gave {var.numpy()}, expected [5.0]")
    opt = pl.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0))
    opt.minimize(lambda: tf.reduce_sum(var * (rank + 1.0)), var_list=[var])
    want = 5.0 - (size + 1) / 2  # gradient rank + 1, averaged over the ranks
    if abs(float(var.numpy()[0]) - want) > 1e-6:
        fail(rank, f"eager DistributedOptimizer step gave {var.numpy()}, expected {want}")


def main() -> None:
    pl.init()
    rank, size = pl.rank(), pl.size()
    check_shard(rank, size)
    check_config(rank, size)
    check_eager(rank, size)
    print(f"[rank {rank}] OK: data.shard and config helpers", flush=True)


if __name__ == "__main__":
    main()
