"""DistributedGradientTape and PartialDistributedGradientTape for TF2 custom training loops.

    with tf.GradientTape() as tape:
        loss = ...
    tape = perseus_legacy.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)  # averaged over all ranks
"""

from __future__ import annotations

from typing import Any, Iterable

import tensorflow as tf

from perseus_legacy.common.basics import Average
from perseus_legacy.tensorflow.compression import Compression
from perseus_legacy.tensorflow.reduction import GradientReducer, resolve_groups


class _DistributedTape:
    """Mixed into the wrapped tape's class: gradient() reduces what the tape computed."""

    _perseus_reducer: GradientReducer

    def register_local_source(self, source: Any) -> None:
        """Keeps `source`'s gradient on this rank: not reduced, divided by size() (Horovod's
        scale_local_gradients)."""
        self._perseus_reducer.register_local(source)

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
                 use_generic_names: bool = False) -> Any:
        """The tape's gradients of `target` w.r.t. `sources`, reduced over all ranks.

        Every rank must call it with the same sources, in the same order.
        """
        grads = super().gradient(target, sources, output_gradients,  # type: ignore[misc]
                                 unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        reduced = self._perseus_reducer.reduce(list(zip(flat_grads, flat_sources)))
        return tf.nest.pack_sequence_as(grads, [g for g, _ in reduced])

    def get_local_and_global_gradients(self, target: Any, sources: list,
                                       output_gradients: Any = None) -> tuple:
        """([(source, gradient)] of the local sources, the same of the others)."""
        grads = self.gradient(target, sources, output_gradients)
        local = self._perseus_reducer.local
        pairs = list(zip(sources, grads))
        return ([p for p in pairs if p[0].ref() in local],
                [p for p in pairs if p[0].ref() not in local])


_classes: dict = {}


def _distributed_class(base: type) -> type:
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedTape, base), {"__module__": base.__module__})
        _classes[base] = cls
    return cls


def DistributedGradientTape(gradtape: tf.GradientTape,  # noqa: N802 (Horovod's API)
                            device_dense: str = "", device_sparse: str = "",
                            compression: Any = Compression.none, sparse_as_dense: bool = False,
                            op: int = Average, gradient_predivide_factor: float = 1.0,
                            num_groups: int = 0, groups: Any = None,
                            scale_local_gradients: bool = True,
                            process_set: Any = None) -> tf.GradientTape:
    """A tape recording what `gradtape` recorded whose gradient() reduces over all ranks.

    Args:
      gradtape: the tf.GradientTape to wrap (once: a distributed tape is refused).
      device_dense: ignored (Horovod's): every kernel runs on the CPU.
      device_sparse: ignored, likewise.
      compression: `Compression.none`, or `Compression.fp16` to send float gradients as
        float16.
      sparse_as_dense: convert sparse gradients to dense tensors; otherwise they are
        allgathered and stay sparse.
      op: Average (default), Sum, or Adasum (the gradients combined by
        perseus_legacy.tensorflow.adasum).
      gradient_predivide_factor: f (op=Average only) divides by f before the sum and
        multiplies by f/size() after it.
      num_groups: Horovod's deprecated spelling of `groups`.
      groups: None (one fused reduction), a count of contiguous groups, or lists of variables
        (one reduction each), as in Horovod.
      scale_local_gradients: divide the gradients of sources given to register_local_source
        (which are not reduced) by size().
      process_set: reduce over this ProcessSet's ranks only (default: every rank).

    Returns:
      A tape of the same class whose gradient() returns the reduced gradients.

    Raises:
      ValueError: `gradtape` is already distributed, a predivide factor with an op other
        than Average, or bad `groups`.
    """
    if isinstance(gradtape, _DistributedTape):
        raise ValueError("this GradientTape is already distributed: wrap the plain tape once")
    reducer = GradientReducer("DistributedGradientTape", compression, sparse_as_dense, op,
                              gradient_predivide_factor, resolve_groups(num_groups, groups),
                              scale_local_gradients, process_set)
    tape = _distributed_class(type(gradtape))(
        persistent=gradtape._persistent,
        watch_accessed_variables=gradtape._watch_accessed_variables)
    tape._tape = gradtape._tape  # the operations recorded so far (or None before recording)
    tape._perseus_reducer = reducer
    return tape


def local_layer_variables(local_layers: Any) -> list:
    """The trainable variables of a layer or of an iterable of layers (None: none)."""
    if local_layers is None:
        return []
    layers: Iterable = [local_layers] if hasattr(local_layers, "trainable_weights") \
        else local_layers
    layers = list(layers)
    for layer in layers:
        if not hasattr(layer, "trainable_weights"):
            raise ValueError(f"local_layers must be Keras layers, got {type(layer).__name__}")
    return [var for layer in layers for var in layer.trainable_weights]


def PartialDistributedGradientTape(gradtape: tf.GradientTape,  # noqa: N802 (Horovod's API)
                                   device_dense: str = "", device_sparse: str = "",
                                   compression: Any = Compression.none,
                                   sparse_as_dense: bool = False, op: int = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None, local_layers: Any = None,
                                   scale_local_gradients: bool = True,
                                   process_set: Any = None) -> tf.GradientTape:
    """DistributedGradientTape whose `local_layers`' gradients stay on this rank.

    Those gradients are not reduced; with `scale_local_gradients` they are divided by size(),
    as in Horovod.

    Args:
      local_layers: a Keras layer or an iterable of layers whose trainable variables stay
        local (None: none).
      The others: as for DistributedGradientTape.

    Raises:
      ValueError: `local_layers` holds something that is not a layer, or as for
        DistributedGradientTape.
    """
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, scale_local_gradients, process_set)
    for var in local_layer_variables(local_layers):
        tape.register_local_source(var)
    return tape
