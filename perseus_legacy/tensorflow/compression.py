"""Gradient compression applied around an allreduce: compress, reduce, decompress."""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class NoneCompressor:
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: Any) -> tuple:
        """Returns (tensor to send, context for decompress)."""
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Returns the received tensor unchanged."""
        return tensor


class FP16Compressor:
    """Sends floating-point tensors as float16 (half the bytes); other dtypes unchanged.

    Values beyond float16's range (about 6.5e4) overflow to inf: scale the loss down first if
    gradients can be that large.
    """

    @staticmethod
    def compress(tensor: Any) -> tuple:
        """Returns (tensor cast to float16 if it is floating point, its original dtype)."""
        dtype = tensor.dtype
        if dtype.is_floating and dtype != tf.float16:
            return tf.cast(tensor, tf.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Casts the received tensor back to the dtype it had before compress()."""
        if ctx is not None and tensor.dtype != ctx:
            return tf.cast(tensor, ctx)
        return tensor


class Compression:
    """The compressors DistributedOptimizer accepts: `Compression.none`, `Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
