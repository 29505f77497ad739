"""perseus_legacy: synchronous data-parallel training for TF1-style, Estimator and Keras code.

Horovod-compatible: `import perseus_legacy as hvd`.
"""

# First: every change this package makes to TensorFlow (perseus_legacy.tf_compat); legacy Keras
# must be selected before anything imports tensorflow.
from perseus_legacy import tf_compat  # noqa: I001

tf_compat.apply()

# ruff: noqa: E402
from perseus_legacy import data, elastic, estimator  # noqa: F401
from perseus_legacy._version import __version__  # noqa: F401
from perseus_legacy.basics import (  # noqa: F401
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
from perseus_legacy.compression import Compression  # noqa: F401
from perseus_legacy.config import (  # noqa: F401
    checkpoint_dir,
    is_chief,
    scale_learning_rate,
    scale_steps,
    session_config,
)
from perseus_legacy.estimator import estimator_hooks, run_config  # noqa: F401
from perseus_legacy.gradient_tape import (  # noqa: F401
    DistributedGradientTape,
    PartialDistributedGradientTape,
)
from perseus_legacy.graph_rewrite import GraphRewriteError, distribute_graph  # noqa: F401
from perseus_legacy.hooks import (  # noqa: F401
    BroadcastGlobalVariablesHook,
    SyncReplicasHook,
    broadcast_global_variables,
    broadcast_variables,
)
from perseus_legacy.objects import (  # noqa: F401
    allgather_object,
    broadcast_object,
    broadcast_object_fn,
)
from perseus_legacy.ops import (  # noqa: F401
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
from perseus_legacy.optimizer import DistributedOptimizer, SyncReplicasOptimizer  # noqa: F401
from perseus_legacy.preemption import PreemptionHook  # noqa: F401
from perseus_legacy.process_sets import (  # noqa: F401
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)


def __getattr__(name: str):
    # SyncBatchNormalization is a Keras layer: Keras is imported only when it is asked for.
    if name == "SyncBatchNormalization":
        from perseus_legacy.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module 'perseus_legacy' has no attribute {name!r}")
