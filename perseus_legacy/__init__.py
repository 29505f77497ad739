"""perseus_legacy: synchronous data-parallel training for TF1-style, Estimator and Keras code.

Horovod-compatible: `import perseus_legacy as hvd`.
"""

# First: every change this package makes to TensorFlow (perseus_legacy.tf_compat); legacy Keras
# must be selected before anything imports tensorflow.
from perseus_legacy import tf_compat  # noqa: I001

tf_compat.apply()

# ruff: noqa: E402
from perseus_legacy import data, estimator  # noqa: F401
from perseus_legacy._version import __version__  # noqa: F401
from perseus_legacy.basics import (  # noqa: F401
    Average,
    Max,
    Min,
    NotInitializedError,
    Product,
    Sum,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_threads_supported,
    rank,
    shutdown,
    size,
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
from perseus_legacy.graph_rewrite import GraphRewriteError, distribute_graph  # noqa: F401
from perseus_legacy.hooks import (  # noqa: F401
    BroadcastGlobalVariablesHook,
    SyncReplicasHook,
    broadcast_global_variables,
    broadcast_variables,
)
from perseus_legacy.ops import (  # noqa: F401
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allreduce,
)
from perseus_legacy.optimizer import DistributedOptimizer, SyncReplicasOptimizer  # noqa: F401
