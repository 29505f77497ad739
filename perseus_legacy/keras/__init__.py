"""perseus_legacy for tf-keras: `import perseus_legacy.keras as hvd`, like horovod.tensorflow.keras.

    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(tf_keras.optimizers.SGD(0.01 * hvd.size())),
                  loss=...)
    model.fit(x_shard, y_shard, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                           hvd.callbacks.MetricAverageCallback()])

Models, layers and optimizers are tf-keras (Keras 2): `import tf_keras`, or `tf.keras` when
perseus_legacy was imported before tensorflow (it selects TF_USE_LEGACY_KERAS=1).
"""

from perseus_legacy import (  # noqa: F401
    Average,
    Compression,
    Max,
    Min,
    NotInitializedError,
    Product,
    Sum,
    allgather,
    allreduce,
    alltoall,
    broadcast,
    cross_rank,
    cross_size,
    grouped_allreduce,
    init,
    is_chief,
    is_initialized,
    local_rank,
    local_size,
    mpi_threads_supported,
    rank,
    scale_learning_rate,
    shutdown,
    size,
)
from perseus_legacy.keras import callbacks  # noqa: F401
from perseus_legacy.keras._optimizer import (  # noqa: F401
    DistributedOptimizer,
    load_model,
)
from perseus_legacy.keras.callbacks import broadcast_model, broadcast_variables  # noqa: F401
