"""perseus_legacy: synchronous data-parallel training for TF1-style, Estimator and Keras code.

Horovod-compatible: `import perseus_legacy as hvd`.
"""

# First: selects legacy Keras (tf-keras) before tf.keras resolves and makes tf.estimator
# importable on TensorFlow >= 2.16.
from perseus_legacy import estimator  # noqa: F401, I001
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
from perseus_legacy.ops import (  # noqa: F401
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allreduce,
)

from perseus_legacy import data  # noqa: F401
from perseus_legacy.compression import Compression  # noqa: F401
from perseus_legacy.estimator import estimator_hooks  # noqa: F401
from perseus_legacy.config import (  # noqa: F401
    checkpoint_dir,
    is_chief,
    run_config,
    scale_learning_rate,
    scale_steps,
    session_config,
)
from perseus_legacy.graph_rewrite import GraphRewriteError, distribute_graph  # noqa: F401
from perseus_legacy.hooks import (  # noqa: F401
    BroadcastGlobalVariablesHook,
    SyncReplicasHook,
    broadcast_global_variables,
    broadcast_variables,
)
from perseus_legacy.optimizer import DistributedOptimizer, SyncReplicasOptimizer  # noqa: F401
from perseus_legacy._version import __version__  # noqa: F401
