"""perseus_legacy for Keras 2: `import perseus_legacy.keras as hvd`, like horovod.tensorflow.keras.

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())),
                  loss=...)
    model.fit(x_shard, y_shard, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                           hvd.callbacks.MetricAverageCallback()])

Models, layers and optimizers are Keras 2: on TensorFlow < 2.16 `tf.keras`; on later versions
tf-keras (`import tf_keras`, or `tf.keras` when perseus_legacy was imported before tensorflow:
it selects TF_USE_LEGACY_KERAS=1).
"""

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
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from perseus_legacy.common.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from perseus_legacy.keras import callbacks, elastic
from perseus_legacy.keras.callbacks import broadcast_model, broadcast_variables
from perseus_legacy.keras.collectives import allgather, allreduce, broadcast, reducescatter
from perseus_legacy.keras.optimizer import (
    DistributedOptimizer,
    PartialDistributedOptimizer,
    load_model,
)
from perseus_legacy.tensorflow.collectives import alltoall, grouped_allreduce
from perseus_legacy.tensorflow.compression import Compression
from perseus_legacy.tf1.config import is_chief, scale_learning_rate
from perseus_legacy.tf1.hooks import broadcast_global_variables

# The public API (tests/test_public_api.py checks it against docs/).
__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "Max", "Min",
    "NotInitializedError", "PartialDistributedOptimizer", "ProcessSet", "Product", "Sum",
    "add_process_set", "allgather", "allreduce", "alltoall",
    "broadcast", "broadcast_global_variables", "broadcast_model", "broadcast_variables",
    "callbacks", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allreduce", "init",
    "is_chief", "is_initialized", "load_model", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "reducescatter",
    "remove_process_set", "rocm_built", "scale_learning_rate", "shutdown", "size",
    "start_timeline", "stop_timeline",
]
