"""perseus_legacy: synchronous data-parallel training for TF1-style, Estimator and Keras code.

Horovod-compatible: `import perseus_legacy as hvd`. The package is split by role:

- common/      framework-free: init and rank queries, process sets, Python objects between
               ranks, the TF_CONFIG cluster (no TensorFlow import)
- tensorflow/  TensorFlow collectives and their gradients, Adasum, compression, the gradient
               reducer and accumulator, DistributedGradientTape
- tf1/         tf.compat.v1 training: hooks, graph rewrite, optimizers, input sharding, session
               helpers
- keras/, estimator/, elastic/   the Keras 2, tf.estimator and elastic integrations
- tf_compat/   every change made to TensorFlow and tensorflow-estimator
- timeline.py  `python -m perseus_legacy.timeline merge`: one trace from the ranks' timelines

This module is the flat Horovod-style API over them. Each module has one path, the one above
(`perseus_legacy.data` is tf1/data.py, an attribute of this API).
"""

# First: every change this package makes to TensorFlow (perseus_legacy.tf_compat); legacy Keras
# must be selected before anything imports tensorflow.
from perseus_legacy import tf_compat  # noqa: I001

tf_compat.apply()

# ruff: noqa: E402
from perseus_legacy import elastic, estimator
from perseus_legacy._version import __version__
from perseus_legacy.common.basics import (
    Adasum,
    Average,
    Max,
    Min,
    NotInitializedError,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    gpu_available,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    runtime_stats,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from perseus_legacy.common.objects import (
    allgather_object,
    broadcast_object,
    broadcast_object_fn,
)
from perseus_legacy.common.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from perseus_legacy.estimator import estimator_hooks, run_config
from perseus_legacy.tensorflow.collectives import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    reducescatter,
    size_op,
)
from perseus_legacy.tensorflow.compression import Compression
from perseus_legacy.tensorflow.gradient_tape import (
    DistributedGradientTape,
    PartialDistributedGradientTape,
)
from perseus_legacy.tf1 import data
from perseus_legacy.tf1.config import (
    checkpoint_dir,
    is_chief,
    scale_learning_rate,
    scale_steps,
    session_config,
)
from perseus_legacy.tf1.graph_rewrite import GraphRewriteError, distribute_graph
from perseus_legacy.tf1.hooks import (
    BroadcastGlobalVariablesHook,
    SyncReplicasHook,
    broadcast_global_variables,
    broadcast_variables,
)
from perseus_legacy.tf1.optimizer import DistributedOptimizer, SyncReplicasOptimizer
from perseus_legacy.tf1.per_rank import PerRankUpdateError, per_rank_update
from perseus_legacy.tf1.preemption import PreemptionHook

# The public API (tests/test_public_api.py checks it against docs/). SyncBatchNormalization is a
# Keras layer: Keras is imported only when it is asked for (__getattr__).
__all__ = [
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "Compression", "DistributedGradientTape",
    "DistributedOptimizer", "GraphRewriteError", "Max", "Min", "NotInitializedError",
    "PartialDistributedGradientTape", "PerRankUpdateError", "PreemptionHook", "ProcessSet",
    "Product", "Sum",
    "SyncBatchNormalization", "SyncReplicasHook", "SyncReplicasOptimizer", "__version__",
    "add_process_set", "allgather",
    "allgather_object", "allreduce", "alltoall", "broadcast", "broadcast_",
    "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "broadcast_variables", "ccl_built", "checkpoint_dir", "cross_rank", "cross_size",
    "cuda_built", "data", "ddl_built", "distribute_graph", "elastic", "estimator",
    "estimator_hooks", "global_process_set", "gloo_built", "gloo_enabled", "gpu_available",
    "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "init", "is_chief",
    "is_homogeneous", "is_initialized", "join", "local_rank", "local_rank_op", "local_size",
    "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
    "per_rank_update", "process_set_included_op", "rank", "rank_op", "reducescatter",
    "remove_process_set",
    "rocm_built", "run_config", "runtime_stats", "scale_learning_rate", "scale_steps",
    "session_config", "shutdown", "size", "size_op", "start_timeline", "stop_timeline",
]


def __getattr__(name: str):
    if name == "SyncBatchNormalization":
        from perseus_legacy.keras.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module 'perseus_legacy' has no attribute {name!r}")
