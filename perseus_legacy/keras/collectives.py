"""Horovod's Keras collectives: tensor-compatible values in, the reduced tensor out."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from perseus_legacy.common.basics import Average
from perseus_legacy.tensorflow import collectives
from perseus_legacy.tensorflow.compression import Compression


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              op: int | None = None, compression: Any = Compression.none) -> tf.Tensor:
    """perseus_legacy.allreduce of `value` (default Average).

    Args:
      value: a tensor or anything tf.convert_to_tensor accepts.
      name: names the collective.
      average: Horovod's deprecated spelling of `op`.
      prescale_factor: multiplies each rank's value before the reduction.
      postscale_factor: multiplies the result.
      op: Average, Sum, Min, Max, Product or Adasum.
      compression: `Compression.none` or `Compression.fp16`.

    Returns:
      The reduced tensor.
    """
    return collectives.allreduce(tf.convert_to_tensor(value), average=average, op=op, name=name,
                         prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                         compression=compression)


def allgather(value: Any, name: str | None = None) -> tf.Tensor:
    """perseus_legacy.allgather of `value`."""
    return collectives.allgather(tf.convert_to_tensor(value), name=name)


def broadcast(value: Any, root_rank: int, name: str | None = None) -> tf.Tensor:
    """perseus_legacy.broadcast of `value` from `root_rank`."""
    return collectives.broadcast(tf.convert_to_tensor(value), root_rank, name=name)


def reducescatter(value: Any, name: str | None = None, op: int = Average) -> tf.Tensor:
    """perseus_legacy.reducescatter of `value`."""
    return collectives.reducescatter(tf.convert_to_tensor(value), op=op, name=name)
