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

from perseus_legacy import (  # noqa: F401
    Adasum,
    Average,
    Compression,
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
    is_chief,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    scale_learning_rate,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from perseus_legacy.hooks import broadcast_global_variables  # noqa: F401
from perseus_legacy.keras import callbacks, elastic  # noqa: F401
from perseus_legacy.keras._optimizer import (  # noqa: F401
    DistributedOptimizer,
    PartialDistributedOptimizer,
    load_model,
)
from perseus_legacy.keras.callbacks import broadcast_model, broadcast_variables  # noqa: F401
from perseus_legacy.keras.collectives import (  # noqa: F401
    allgather,
    allreduce,
    broadcast,
    reducescatter,
)
from perseus_legacy.ops import alltoall, grouped_allreduce  # noqa: F401
from perseus_legacy.process_sets import (  # noqa: F401
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
