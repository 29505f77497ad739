"""Runs on every task of a Slurm job (tests/test_slurm.py): the rank layout Slurm gave, then
DistributedOptimizer training (Adam, MonitoredTrainingSession, rank-0 checkpoints) equal to a
single-process run on the global batch (the model and reference of train_models.py), its
gradients reduced hierarchically (the runtime found the same nodes: several tasks on each).

Usage: slurm_train.py CONTROLLER NODES TASKS_PER_NODE SHARED_DIR
CONTROLLER (mpi or tcp) is the transport the job must have chosen by itself.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy as pl

import os
import socket
import sys

import train_models
from train_models import RTOL, ATOL, VAR_NAMES, check_checkpoint_files, distributed, reference
from worker_util import assert_close, fail

from perseus_legacy.common import tf_config

CONTROLLER, NODES, TASKS_PER_NODE, SHARED = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    sys.argv[4]


def check_layout(rank: int, size: int) -> None:
    """Slurm's block distribution: rank r is local task r % TASKS_PER_NODE of node
    r // TASKS_PER_NODE, and the local/cross ranks say the same as SLURM_LOCALID/NODEID."""
    got = (pl.local_rank(), pl.local_size(), pl.cross_rank(), pl.cross_size())
    expected = (rank % TASKS_PER_NODE, TASKS_PER_NODE, rank // TASKS_PER_NODE, NODES)
    print(f"[rank {rank}] layout host={socket.gethostname()} controller="
          f"{tf_config.controller_from_env()} local_rank={got[0]} cross_rank={got[2]} "
          f"SLURM_PROCID={os.environ.get('SLURM_PROCID')} "
          f"SLURM_LOCALID={os.environ.get('SLURM_LOCALID')}", flush=True)
    if size != NODES * TASKS_PER_NODE or got != expected:
        fail(rank, f"size {size}, (local_rank, local_size, cross_rank, cross_size) {got}; "
                   f"expected size {NODES * TASKS_PER_NODE} and {expected}")
    if tf_config.controller_from_env() != CONTROLLER:
        fail(rank, f"the job chose the {tf_config.controller_from_env()} controller, expected "
                   f"{CONTROLLER}")
    # Where Slurm started the ranks themselves (srun), its task ids are the ranks; under mpirun
    # in an allocation they are those of the daemon step that srun started on each node.
    slurm = (os.environ.get("SLURM_LOCALID"), os.environ.get("SLURM_NODEID"))
    slurm_placed = (os.environ.get("SLURM_PROCID"), os.environ.get("SLURM_STEP_NUM_TASKS")) == \
        (str(rank), str(size))
    if slurm_placed and slurm != (str(got[0]), str(got[2])):
        fail(rank, f"local_rank {got[0]}, cross_rank {got[2]}; Slurm says SLURM_LOCALID="
                   f"{slurm[0]} SLURM_NODEID={slurm[1]}")


def main() -> None:
    pl.init()
    rank, size = pl.rank(), pl.size()
    # Equal slices of the global batch: the mean of the ranks' mean gradients is the global one.
    train_models.GLOBAL_BATCH = 2 * size
    check_layout(rank, size)
    root = os.path.join(SHARED, "ckpt")
    expected = reference("adam")
    got = distributed("adam", rank, size, "monitored", checkpoint_root=root)
    for name, g, e in zip(VAR_NAMES, got, expected):
        assert_close(rank, f"adam: {name}", g, e, rtol=RTOL, atol=ATOL)
    check_checkpoint_files(rank, size, root, expected)
    hierarchical = pl.runtime_stats()["hierarchical_allreduces"]
    if TASKS_PER_NODE > 1 and NODES > 1 and hierarchical == 0:
        fail(rank, f"no allreduce ran hierarchically on {NODES} nodes of {TASKS_PER_NODE} tasks: "
                   "the runtime did not find the nodes Slurm gave")
    print(f"[rank {rank}] slurm training OK on {socket.gethostname()}", flush=True)


if __name__ == "__main__":
    main()
