"""Adasum, Horovod's adaptive summation, as a reduce op: `allreduce(t, op=perseus_legacy.Adasum)`.

Two tensors a and b combine into (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b: their sum
when they are orthogonal, their mean when they are parallel; the coefficient of a tensor that is
zero stays 1. Ranks are combined in a binary tree (rank 0 with 1, 2 with 3, ..., then those
results pairwise, ...), every tensor on its own, so the number of ranks must be a power of 2.

Built on allgather (perseus_legacy.tensorflow.collectives gathers, this module combines), with
no operation of its own in the native runtime: every rank receives
every rank's tensor and computes the same tree, in the same order, with the same kernels (dot
products accumulate in float64), so every rank gets bitwise the same result. Each rank receives
size() x the tensor; Horovod's native Adasum halves the vector at every level and moves about 2x.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from perseus_legacy.common import basics

FLOAT_TYPES = (tf.float16, tf.float32, tf.float64)
# A squared norm below this counts as zero (its coefficient stays 1), Horovod's threshold.
_ZERO_NORM_SQUARED = float(np.sqrt(np.finfo(np.float64).tiny))


def check_rank_count(size: int, what: str) -> None:
    """NotImplementedError naming the rank count unless it is a power of 2."""
    if size < 1 or size & (size - 1):
        raise NotImplementedError(
            f"{what} with op=Adasum needs a power-of-2 number of ranks (the tree combines them "
            f"in pairs); rank {basics.rank()} is one of {size}")


def checked(tensor: Any, index: int, what: str) -> tf.Tensor:
    if isinstance(tensor, tf.IndexedSlices):
        raise NotImplementedError(
            f"{what} with op=Adasum does not take tf.IndexedSlices (tensor {index}): convert it "
            "with tf.convert_to_tensor, or pass sparse_as_dense=True to the distributed "
            "optimizer or tape (as in Horovod)")
    tensor = tf.convert_to_tensor(tensor)
    if tensor.dtype not in FLOAT_TYPES:
        raise TypeError(f"{what} with op=Adasum combines float16, float32 and float64 tensors; "
                        f"tensor {index} is {tensor.dtype.name}")
    return tensor


@tf.custom_gradient
def not_differentiable(*tensors: tf.Tensor) -> tuple:
    def gradient(*_: Any) -> None:
        raise ValueError("perseus_legacy.allreduce with op=Adasum is not differentiable; only "
                         "Average and Sum have gradients")

    return list(tensors), gradient


def _coefficient(dot: tf.Tensor, norm_squared: tf.Tensor) -> tf.Tensor:
    nonzero = norm_squared >= _ZERO_NORM_SQUARED
    safe = tf.where(nonzero, norm_squared, tf.ones_like(norm_squared))
    return tf.where(nonzero, 1.0 - dot / safe * 0.5, tf.ones_like(dot))


def combine_tree(columns: tf.Tensor, segment_ids: tf.Tensor, size: int) -> tf.Tensor:
    """The tree over `columns` [elements, size] (column r: rank r's tensors, concatenated);
    `segment_ids` [elements] says which tensor each element belongs to. Returns [elements]."""
    while size > 1:
        a = tf.cast(columns[:, 0::2], tf.float64)
        b = tf.cast(columns[:, 1::2], tf.float64)
        dot = tf.math.segment_sum(a * b, segment_ids)  # [tensors, pairs]
        a_coefficient = _coefficient(dot, tf.math.segment_sum(a * a, segment_ids))
        b_coefficient = _coefficient(dot, tf.math.segment_sum(b * b, segment_ids))
        combined = (tf.gather(a_coefficient, segment_ids) * a
                    + tf.gather(b_coefficient, segment_ids) * b)
        columns = tf.cast(combined, columns.dtype)
        size //= 2
    return columns[:, 0]


def row_of(tensors: list) -> tuple:
    """(every tensor flattened and concatenated into one row, the element count of each)."""
    flat = [tf.reshape(t, [-1]) for t in tensors]
    counts = [tf.size(f) for f in flat]
    return (flat[0] if len(flat) == 1 else tf.concat(flat, 0)), counts


def combine_rows(gathered: tf.Tensor, tensors: list, counts: list, size: int) -> list:
    """The tree over `gathered` [size, elements] (row r: rank r's row_of(tensors)), split back
    into tensors shaped like `tensors`."""
    segment_ids = tf.repeat(tf.range(len(tensors)), tf.stack(counts))
    combined = combine_tree(tf.transpose(gathered), segment_ids, size)
    parts = [combined] if len(tensors) == 1 else tf.split(combined, tf.stack(counts),
                                                          num=len(tensors))
    return [tf.reshape(part, tf.shape(t)) for part, t in zip(parts, tensors)]

