"""DistributedOptimizer: wraps a tf.compat.v1 optimizer so gradients are reduced over all ranks."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from perseus_legacy import basics, ops
from perseus_legacy.basics import Average
from perseus_legacy.compression import Compression


def _reduce_gradient(grad: Any, var: Any, op: int, compression: Any, sparse_as_dense: bool,
                     prefix: str) -> Any:
    if grad is None:
        return None
    # Named after the variable: ranks agree on the name whatever order they build gradients in.
    var_name = var.name if tf.executing_eagerly() else var.op.name
    name = f"{prefix}_Allreduce_{var_name.split(':')[0]}"
    if isinstance(grad, tf.IndexedSlices) and sparse_as_dense:
        grad = tf.convert_to_tensor(grad)
    if isinstance(grad, tf.IndexedSlices):
        values, ctx = compression.compress(grad.values)
        reduced = ops.allreduce(tf.IndexedSlices(values, grad.indices, grad.dense_shape),
                                op=op, name=name)
        return tf.IndexedSlices(compression.decompress(reduced.values, ctx), reduced.indices,
                                reduced.dense_shape)
    compressed, ctx = compression.compress(grad)
    return compression.decompress(ops.allreduce(compressed, op=op, name=name), ctx)


class DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A `tf.compat.v1.train.Optimizer` whose gradients are averaged (by default) over all ranks.

    `compute_gradients` returns the wrapped optimizer's gradients reduced with `op` over every
    rank, so `minimize`/`apply_gradients` take the same step on every rank. Sparse gradients
    (`tf.IndexedSlices`, e.g. of an embedding lookup) are allgathered and stay sparse unless
    `sparse_as_dense=True`. `compression=Compression.fp16` sends float gradients as float16.
    Every rank must build the same trainable variables (their names name the collectives).
    """

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, name: str | None = None,
                 use_locking: bool = False, compression: Any = Compression.none,
                 sparse_as_dense: bool = False, op: int = Average,
                 backward_passes_per_step: int = 1) -> None:
        if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
            raise TypeError(
                "DistributedOptimizer wraps a tf.compat.v1.train.Optimizer, got "
                f"{type(optimizer).__name__}; Keras optimizers need the Keras wrapper")
        if int(backward_passes_per_step) < 1:
            raise ValueError(
                f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if int(backward_passes_per_step) != 1:
            raise NotImplementedError(
                "DistributedOptimizer(backward_passes_per_step > 1) (local gradient accumulation) "
                "is not implemented yet; use backward_passes_per_step=1 and a larger batch, or "
                "accumulate gradients yourself before apply_gradients")
        ops._check_op(op)
        if name is None:
            name = "Distributed" + type(optimizer).__name__
        super().__init__(use_locking=use_locking, name=name)
        self._optimizer = optimizer
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._reduce_op = op
        self._backward_passes_per_step = int(backward_passes_per_step)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's (gradient, variable) pairs, gradients reduced over all ranks."""
        grads_and_vars = self._optimizer.compute_gradients(*args, **kwargs)
        basics.require_initialized("DistributedOptimizer.compute_gradients()")
        if basics.size() == 1 and self._reduce_op == Average:
            return grads_and_vars
        with tf.name_scope(self._name + "_Allreduce"):
            return [(_reduce_gradient(grad, var, self._reduce_op, self._compression,
                                      self._sparse_as_dense, self._name), var)
                    for grad, var in grads_and_vars]

    def apply_gradients(self, *args: Any, **kwargs: Any) -> Any:
        """Applies already reduced gradients with the wrapped optimizer."""
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's slot variable."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's slot names."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's variables (slots, beta powers, ...)."""
        return self._optimizer.variables(*args, **kwargs)
