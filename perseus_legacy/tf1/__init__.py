"""tf.compat.v1 training: SessionRunHooks, the graph rewrite, DistributedOptimizer and
SyncReplicasOptimizer, input sharding and session helpers. Built on perseus_legacy.tensorflow."""
