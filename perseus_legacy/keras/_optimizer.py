"""DistributedOptimizer for tf-keras optimizers: gradients are reduced over all ranks."""

from __future__ import annotations

from typing import Any

import tensorflow as tf
import tf_keras

from perseus_legacy import basics, ops
from perseus_legacy.basics import Average
from perseus_legacy.compression import Compression

KERAS_OPTIMIZERS = (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer)


class GradientReducer:
    """Reduces a list of (gradient, variable) pairs over all ranks with one grouped allreduce."""

    def __init__(self, name: str, compression: Any = Compression.none,
                 sparse_as_dense: bool = False, op: int = Average,
                 gradient_predivide_factor: float = 1.0) -> None:
        ops._check_op(op)
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor needs op=Average, got "
                             f"op={basics.REDUCE_OP_NAMES[op]}")
        self.name = name
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)

    def reduce(self, grads_and_vars: list) -> list:
        """The same pairs, every gradient reduced over all ranks (None gradients stay None)."""
        basics.require_initialized("DistributedOptimizer.apply_gradients()")
        if (basics.size() == 1 and self.op == Average
                and self.gradient_predivide_factor == 1.0):
            return grads_and_vars
        grads = [grad for grad, _ in grads_and_vars]
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]
        # Average divides by size() itself; predivision splits that division around the sum.
        prescale = 1.0 / self.gradient_predivide_factor
        postscale = self.gradient_predivide_factor
        with tf.name_scope(self.name):
            dense = [i for i, g in enumerate(grads)
                     if g is not None and not isinstance(g, tf.IndexedSlices)]
            compressed = [self.compression.compress(grads[i]) for i in dense]
            reduced = ops.grouped_allreduce([c for c, _ in compressed], op=self.op,
                                            name=self.name, prescale_factor=prescale,
                                            postscale_factor=postscale)
            for i, (_, ctx), result in zip(dense, compressed, reduced):
                grads[i] = self.compression.decompress(result, ctx)
            for i, grad in enumerate(grads):
                if isinstance(grad, tf.IndexedSlices):  # allgathered, stays sparse
                    values, ctx = self.compression.compress(grad.values)
                    result = ops.allreduce(
                        tf.IndexedSlices(values, grad.indices, grad.dense_shape), op=self.op,
                        name=f"{self.name}.sparse.{i}", prescale_factor=prescale,
                        postscale_factor=postscale)
                    grads[i] = tf.IndexedSlices(self.compression.decompress(result.values, ctx),
                                                result.indices, result.dense_shape)
        return [(grad, var) for grad, (_, var) in zip(grads, grads_and_vars)]


class DistributedOptimizerMixin:
    """Reduces the gradients over all ranks at the start of `apply_gradients`.

    `Model.fit` (graph or eager), `minimize` and custom loops that call `apply_gradients` all
    go through it; clipping and the update itself then see the reduced gradients.
    """

    _perseus_reducer: GradientReducer

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        """Reduces the gradients over all ranks, then applies them with the wrapped class."""
        grads_and_vars = self._perseus_reducer.reduce(list(grads_and_vars))
        return super().apply_gradients(grads_and_vars, *args, **kwargs)


_classes: dict = {}


def distributed_class(base: type) -> type:
    """The subclass of optimizer class `base` that reduces gradients (one per base class).

    It carries the base's name and module, so a saved model records the plain optimizer class
    and loads with plain tf-keras too (load_model below re-wraps it).
    """
    if issubclass(base, DistributedOptimizerMixin):
        return base
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (DistributedOptimizerMixin, base),
                   {"__module__": base.__module__, "__qualname__": base.__qualname__,
                    "__doc__": base.__doc__})
        _classes[base] = cls
    return cls


def _check_optimizer(optimizer: Any, backward_passes_per_step: int) -> None:
    if isinstance(optimizer, DistributedOptimizerMixin):
        raise ValueError(f"{type(optimizer).__name__} optimizer is already distributed: wrap the "
                         "plain optimizer once")
    if not isinstance(optimizer, KERAS_OPTIMIZERS):
        hint = ""
        if type(optimizer).__module__.split(".")[0] == "keras":
            hint = (" This is a Keras 3 optimizer: use tf-keras (`import tf_keras`, or "
                    "`import perseus_legacy` before tensorflow so tf.keras is tf-keras)")
        elif isinstance(optimizer, tf.compat.v1.train.Optimizer):
            hint = " For tf.compat.v1.train optimizers use perseus_legacy.DistributedOptimizer"
        raise TypeError("perseus_legacy.keras.DistributedOptimizer wraps a tf-keras optimizer, "
                        f"got {type(optimizer).__module__}.{type(optimizer).__name__}.{hint}")
    if int(backward_passes_per_step) != 1:
        raise NotImplementedError(
            f"DistributedOptimizer(backward_passes_per_step={backward_passes_per_step}): local "
            "gradient accumulation is not implemented; use backward_passes_per_step=1 and a "
            "larger batch")


def DistributedOptimizer(optimizer: Any, name: str | None = None,  # noqa: N802 (Horovod's API)
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         op: int = Average, backward_passes_per_step: int = 1,
                         gradient_predivide_factor: float = 1.0) -> Any:
    """A new optimizer of `optimizer`'s class and config whose gradients are reduced over ranks.

    The result is an instance of (a subclass of) the same tf-keras optimizer class, built from
    `optimizer.get_config()`: pass it to `model.compile`. `name` names the collectives (default
    "Distributed" + class name), not the optimizer. Sparse gradients are allgathered and stay
    sparse unless `sparse_as_dense=True`; `compression=Compression.fp16` sends float16.
    """
    _check_optimizer(optimizer, backward_passes_per_step)
    wrapped = distributed_class(type(optimizer)).from_config(optimizer.get_config())
    wrapped._perseus_reducer = GradientReducer(
        name or "Distributed" + type(optimizer).__name__, compression, sparse_as_dense, op,
        gradient_predivide_factor)
    return wrapped


def make_distributed(optimizer: Any, compression: Any = Compression.none) -> Any:
    """Turns `optimizer` itself (with its variables and state) into a distributed one."""
    if not isinstance(optimizer, DistributedOptimizerMixin):
        _check_optimizer(optimizer, 1)
    optimizer.__class__ = distributed_class(type(optimizer))
    optimizer._perseus_reducer = GradientReducer(
        "Distributed" + type(optimizer).__name__, compression)
    return optimizer


def load_model(filepath: str, custom_optimizers: list | None = None,
               custom_objects: dict | None = None, compression: Any = Compression.none,
               **kwargs: Any) -> Any:
    """`tf_keras.models.load_model`, with the restored optimizer (state kept) made distributed.

    `custom_optimizers` lists optimizer classes the file names that tf-keras does not know;
    other keyword arguments go to tf_keras.models.load_model.
    """
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = tf_keras.models.load_model(filepath, custom_objects=objects, **kwargs)
    if isinstance(getattr(model, "optimizer", None), KERAS_OPTIMIZERS):
        make_distributed(model.optimizer, compression)
    return model
