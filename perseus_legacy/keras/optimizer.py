"""DistributedOptimizer for Keras 2 optimizers: gradients are reduced over all ranks."""

from __future__ import annotations

import sys
from typing import Any, Callable

import tensorflow as tf

from perseus_legacy.common import basics
from perseus_legacy.common.basics import Average, Sum
from perseus_legacy.keras.keras2 import LEGACY_OPTIMIZER_CLASSES, OPTIMIZER_CLASSES, keras
from perseus_legacy.tensorflow.accumulation import GradientAccumulator
from perseus_legacy.tensorflow.compression import Compression
from perseus_legacy.tensorflow.gradient_tape import local_layer_variables
from perseus_legacy.tensorflow.reduction import GradientReducer, resolve_groups


def build_optimizer(optimizer: Any, variables: list) -> None:
    """Creates the optimizer's variables (slots) for `variables` if it has not yet."""
    with tf.init_scope():
        if isinstance(optimizer, LEGACY_OPTIMIZER_CLASSES):
            optimizer._create_all_weights(variables)
        elif not getattr(optimizer, "_built", False):
            optimizer.build(variables)


def optimizer_variables(optimizer: Any) -> list:
    """A Keras optimizer's variables (a method on legacy optimizers, a property on new ones)."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class _Accumulation:
    """backward_passes_per_step > 1: the sums (summed densely) and how they are averaged."""

    def __init__(self, passes: int, average: bool) -> None:
        self.passes = passes
        self.scale = 1.0 / passes if average else 1.0
        self.sums = GradientAccumulator(_untracked_variable, keep_sparse=False)


def _untracked_variable(initial: Callable[[], tf.Tensor], name: str) -> tf.Variable:
    # Created outside any tf.function, held by a plain object: no checkpoint tracks it.
    with tf.init_scope():
        return tf.Variable(initial, trainable=False, name=f"perseus_gradient_sum_{name}")


class DistributedOptimizerMixin:
    """Reduces the gradients over all ranks at the start of `apply_gradients`.

    `Model.fit` (graph or eager), `minimize` and custom loops that call `apply_gradients` all
    go through it; clipping and the update itself then see the reduced gradients. With
    backward_passes_per_step=k > 1, gradients are summed locally and reduced and applied on
    every k-th call; `iterations` still advances on every call, as in Horovod.
    """

    _perseus_reducer: GradientReducer
    _perseus_accumulation: _Accumulation | None = None

    def register_local_var(self, var: Any) -> None:
        """Keeps `var`'s gradient on this rank: not reduced, divided by size() (Horovod's
        scale_local_gradients)."""
        self._perseus_reducer.register_local(var)

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        """Reduces the gradients over all ranks, then applies them with the wrapped class."""
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        apply = super().apply_gradients  # type: ignore[misc]
        accumulation = self._perseus_accumulation
        if accumulation is None:
            return apply(self._perseus_reducer.reduce(pairs), *args, **kwargs)
        build_optimizer(self, [v for _, v in pairs])
        count = accumulation.sums.add(pairs)

        def reduce_and_apply() -> Any:
            totals = accumulation.sums.totals(accumulation.scale)
            apply(self._perseus_reducer.reduce(totals), *args, **kwargs)
            accumulation.sums.clear()
            return tf.identity(self.iterations)

        def count_pass() -> Any:
            self.iterations.assign_add(1)
            return tf.identity(self.iterations)

        return tf.cond(count >= accumulation.passes, reduce_and_apply, count_pass)


_classes: dict = {}


def distributed_class(base: type) -> type:
    """The subclass of optimizer class `base` that reduces gradients (one per base class).

    It carries the base's name and module, so a saved model records the plain optimizer class
    and loads with plain Keras too (load_model below re-wraps it).
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


def _check_optimizer(optimizer: Any) -> None:
    if isinstance(optimizer, DistributedOptimizerMixin):
        raise ValueError(f"{type(optimizer).__name__} optimizer is already distributed: wrap the "
                         "plain optimizer once")
    if not isinstance(optimizer, OPTIMIZER_CLASSES):
        hint = ""
        package = sys.modules.get(type(optimizer).__module__.split(".")[0])
        if package is not None and package.__name__ == "keras" and \
                str(getattr(package, "__version__", "")).startswith("3."):
            hint = (" This is a Keras 3 optimizer: use tf-keras (`import tf_keras`, or "
                    "`import perseus_legacy` before tensorflow so tf.keras is tf-keras)")
        elif isinstance(optimizer, tf.compat.v1.train.Optimizer):
            hint = " For tf.compat.v1.train optimizers use perseus_legacy.DistributedOptimizer"
        raise TypeError("perseus_legacy.keras.DistributedOptimizer wraps a Keras 2 optimizer, "
                        f"got {type(optimizer).__module__}.{type(optimizer).__name__}.{hint}")


def _wrap(optimizer: Any, reducer: GradientReducer, passes: int = 1,
          average_aggregated_gradients: bool = False) -> Any:
    if int(passes) < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
    wrapped = distributed_class(type(optimizer)).from_config(optimizer.get_config())
    wrapped._perseus_reducer = reducer
    if int(passes) > 1:
        wrapped._perseus_accumulation = _Accumulation(int(passes), average_aggregated_gradients)
    return wrapped


def DistributedOptimizer(optimizer: Any, name: str | None = None,  # noqa: N802 (Horovod's API)
                         device_dense: str = "", device_sparse: str = "",
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         gradient_predivide_factor: float = 1.0, op: int = Average,
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, scale_local_gradients: bool = True,
                         process_set: Any = None) -> Any:
    """A new optimizer of `optimizer`'s class and config whose gradients are reduced over ranks.

    The result is an instance of (a subclass of) the same Keras optimizer class, built from
    `optimizer.get_config()`: pass it to `model.compile`.

    Args:
      optimizer: the Keras 2 optimizer to copy (tf-keras, or tf.keras on TF < 2.16).
      name: names the collectives (default "Distributed" + class name), not the optimizer.
      device_dense: ignored (Horovod's): every kernel runs on the CPU.
      device_sparse: ignored, likewise.
      compression: `Compression.none`, or `Compression.fp16` to send float16.
      sparse_as_dense: convert sparse gradients to dense tensors; otherwise they are
        allgathered and stay sparse.
      gradient_predivide_factor: f (op=Average only) divides by f before the sum and
        multiplies by f/size() after it.
      op: Average (default), Sum or Adasum.
      backward_passes_per_step: k > 1 sums k passes locally before one reduction and update
        (`iterations` still advances on every call, as in Horovod).
      average_aggregated_gradients: apply the mean of the k passes instead of their sum.
      num_groups: Horovod's deprecated spelling of `groups`.
      groups: None (one fused reduction), a count of contiguous groups, or lists of variables.
      scale_local_gradients: divide the gradients of variables given to register_local_var
        (which are not reduced) by size().
      process_set: reduce over this ProcessSet's ranks only (default: every rank).

    Returns:
      The distributed optimizer.

    Raises:
      TypeError: `optimizer` is not a Keras 2 optimizer (a Keras 3 or tf.compat.v1 one).
      ValueError: `optimizer` is already distributed, backward_passes_per_step < 1, a
        predivide factor with an op other than Average, or bad `groups`.
    """
    _check_optimizer(optimizer)
    reducer = GradientReducer(name or "Distributed" + type(optimizer).__name__, compression,
                              sparse_as_dense, op, gradient_predivide_factor,
                              resolve_groups(num_groups, groups), scale_local_gradients,
                              process_set)
    return _wrap(optimizer, reducer, backward_passes_per_step, average_aggregated_gradients)


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None,  # noqa: N802
                                device_dense: str = "", device_sparse: str = "",
                                compression: Any = Compression.none,
                                sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: int = Average,
                                groups: Any = None, local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """DistributedOptimizer whose `local_layers`' gradients stay on this rank (divided by
    size() with `scale_local_gradients`, as in Horovod).

    Args:
      local_layers: a Keras layer or an iterable of layers whose trainable variables stay
        local (None: none).
      op: Average or Sum.
      The others: as for DistributedOptimizer.

    Raises:
      ValueError: op is neither Average nor Sum, or as for DistributedOptimizer.
    """
    if op not in (Average, Sum):
        raise ValueError(f"PartialDistributedOptimizer supports op=Average and op=Sum, not "
                         f"{basics.REDUCE_OP_NAMES.get(op, op)}")
    wrapped = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                                   sparse_as_dense, gradient_predivide_factor, op,
                                   groups=groups, scale_local_gradients=scale_local_gradients)
    for var in local_layer_variables(local_layers):
        wrapped.register_local_var(var)
    return wrapped


def make_distributed(optimizer: Any, compression: Any = Compression.none) -> Any:
    """Turns `optimizer` itself (with its variables and state) into a distributed one."""
    if not isinstance(optimizer, DistributedOptimizerMixin):
        _check_optimizer(optimizer)
    optimizer.__class__ = distributed_class(type(optimizer))
    optimizer._perseus_reducer = GradientReducer(
        "Distributed" + type(optimizer).__name__, compression)
    return optimizer


def load_model(filepath: str, custom_optimizers: list | None = None,
               custom_objects: dict | None = None, compression: Any = Compression.none,
               **kwargs: Any) -> Any:
    """`keras.models.load_model`, with the restored optimizer (state kept) made distributed.

    `custom_optimizers` lists optimizer classes the file names that Keras does not know;
    other keyword arguments go to load_model (Horovod's `legacy_opts` is accepted and unused).
    """
    kwargs.pop("legacy_opts", None)
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects, **kwargs)
    if isinstance(getattr(model, "optimizer", None), OPTIMIZER_CLASSES):
        make_distributed(model.optimizer, compression)
    return model
