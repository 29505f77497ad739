"""SyncBatchNormalization: a Keras 2 BatchNormalization whose batch statistics span all ranks."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from perseus_legacy.common import basics
from perseus_legacy.common.basics import Sum
from perseus_legacy.keras.keras2 import keras
from perseus_legacy.tensorflow import collectives


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization whose training-time mean and variance are those of the global batch.

    Every rank's count, sum and sum of squares are added with one allreduce, so ranks with
    different batch sizes weigh by their rows (Horovod averages the ranks' moments equally;
    the two agree for equal batches). Training on n ranks then normalises exactly as one
    process would on the concatenated batch, gradients included. Inference uses the moving
    statistics, as BatchNormalization does. Not fused (`fused=True` is refused).
    """

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization cannot be fused: pass fused=False")
        kwargs.setdefault("name", "sync_batch_normalization")
        super().__init__(fused=False, **kwargs)

    def _calculate_mean_and_var(self, inputs: Any, reduction_axes: Any, keep_dims: bool,
                                mask: Any = None) -> tuple:
        if basics.size() == 1:
            return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)
        x = tf.cast(inputs, tf.float32) if inputs.dtype == tf.float16 else inputs
        if mask is not None:
            weights = tf.expand_dims(tf.cast(mask, x.dtype), axis=-1)
            x = x * weights
            count = tf.broadcast_to(weights, tf.shape(x))
        else:
            count = tf.ones_like(x)
        local = tf.stack([tf.reduce_sum(count, axis=reduction_axes, keepdims=True),
                          tf.reduce_sum(x, axis=reduction_axes, keepdims=True),
                          tf.reduce_sum(tf.square(x), axis=reduction_axes, keepdims=True)])
        total_count, total, total_squares = tf.unstack(
            collectives.allreduce(local, op=Sum, name=f"{self.name}.moments"))
        mean = total / total_count
        variance = tf.maximum(total_squares / total_count - tf.square(mean), 0.0)
        if not keep_dims:
            mean = tf.squeeze(mean, axis=reduction_axes)
            variance = tf.squeeze(variance, axis=reduction_axes)
        if inputs.dtype == tf.float16:
            mean, variance = tf.cast(mean, tf.float16), tf.cast(variance, tf.float16)
        return mean, variance
