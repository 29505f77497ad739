"""GradientReducer: the gradient reduction DistributedGradientTape and the Keras optimizers share.

One grouped allreduce per group of dense gradients (all of them by default, so the runtime fuses
them), sparse gradients allgathered beside it, local variables' gradients kept on their rank.
In a graph, every reduced gradient is available only once all of them are: an optimizer applying
them updates no variable of a step in which some reduction failed (a lost rank), so every
survivor holds the variables of the last completed step.
"""

from __future__ import annotations

import warnings
from typing import Any

import tensorflow as tf

from perseus_legacy.common import basics
from perseus_legacy.common.basics import Average
from perseus_legacy.tensorflow import collectives
from perseus_legacy.tensorflow.compression import Compression


def check_predivide(gradient_predivide_factor: float, op: int) -> float:
    """The factor as a float; ValueError unless op is Average (Horovod's rule)."""
    collectives._check_op(op)
    if float(gradient_predivide_factor) != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor needs op=Average, got "
                         f"op={basics.REDUCE_OP_NAMES[op]}")
    return float(gradient_predivide_factor)


def resolve_groups(num_groups: int, groups: Any) -> Any:
    """Horovod's `groups` (None, a count > 0, or lists of variables), from the deprecated
    `num_groups` too."""
    if num_groups:
        warnings.warn("num_groups is deprecated, as in Horovod: pass groups=", DeprecationWarning,
                      stacklevel=3)
        groups = num_groups if groups is None else groups
    if groups is not None and not isinstance(groups, list) and not int(groups) > 0:
        raise ValueError(f"groups must be a count > 0 or a list of lists of variables, got "
                         f"{groups!r}")
    return groups


def _after_all(grads: list) -> list:
    """`grads` (tensors or IndexedSlices), each readable only once every one of them is ready."""
    leaves = [t for g in grads for t in ((g.values, g.indices) if isinstance(g, tf.IndexedSlices)
                                          else (g,))]
    # One barrier op between the leaves and the identities: 2N control edges, not N*N (with
    # ~400 gradients that is ~160,000 edges the executor would walk every step).
    with tf.control_dependencies([t.op for t in leaves]):
        barrier = tf.no_op(name="after_all")
    with tf.control_dependencies([barrier]):
        return [tf.IndexedSlices(tf.identity(g.values), tf.identity(g.indices), g.dense_shape)
                if isinstance(g, tf.IndexedSlices) else tf.identity(g) for g in grads]


class GradientReducer:
    """Reduces (gradient, variable) pairs over all ranks (or `process_set`'s).

    Average divides by size() after the sum; `gradient_predivide_factor` f moves 1/f of it
    before the sum (prescale 1/f, postscale f). `groups`: None (one fused reduction), a count
    (the gradients split in that many contiguous groups) or lists of variables (one reduction
    each; variables in no list alone). Gradients of variables given to `register_local` are not
    reduced; with `scale_local_gradients` they are divided by size(), as in Horovod.
    `op=Adasum` combines the dense gradients by Adasum (perseus_legacy.tensorflow.adasum);
    sparse ones need `sparse_as_dense`. With `one_per_variable` (the TF1 DistributedOptimizer),
    `groups` is ignored and each gradient is reduced by a collective of its own, named after
    its variable, so ranks agree on the names whatever order they build the gradients in.

    Args:
      name: names the collectives (and the errors).
      compression: `Compression.none` or `Compression.fp16`.
      sparse_as_dense: convert sparse gradients to dense tensors first.
      op: Average, Sum or Adasum.
      gradient_predivide_factor: f: prescale 1/f, postscale f (op=Average only).
      groups: None, a count > 0, or lists of variables, as above.
      scale_local_gradients: divide the local variables' gradients by size().
      process_set: reduce over this ProcessSet's ranks only (None: every rank).
      one_per_variable: one collective per gradient, named after its variable.

    Raises:
      ValueError: a predivide factor with an op other than Average, an unknown op, or bad
        `groups`.
    """

    def __init__(self, name: str, compression: Any = Compression.none,
                 sparse_as_dense: bool = False, op: int = Average,
                 gradient_predivide_factor: float = 1.0, groups: Any = None,
                 scale_local_gradients: bool = True, process_set: Any = None,
                 one_per_variable: bool = False) -> None:
        self.name = name
        self.one_per_variable = one_per_variable
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.gradient_predivide_factor = check_predivide(gradient_predivide_factor, op)
        self.groups = resolve_groups(0, groups)
        self.scale_local_gradients = scale_local_gradients
        self.process_set = process_set  # None: every rank
        self.local: set = set()

    def register_local(self, var: Any) -> None:
        """Keeps `var`'s gradient on this rank (not reduced)."""
        self.local.add(var.ref())

    @tf.autograph.experimental.do_not_convert
    def reduce(self, grads_and_vars: list) -> list:
        """The same pairs, every gradient reduced over all ranks (None gradients stay None)."""
        basics.require_initialized(f"{self.name}: reducing gradients")
        grads = [grad for grad, _ in grads_and_vars]
        variables = [var for _, var in grads_and_vars]
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]
        size = self._size()
        shared = [i for i, (g, v) in enumerate(zip(grads, variables))
                  if g is not None and v.ref() not in self.local]
        if self.one_per_variable and (size > 1 or self.op != Average
                                      or self.gradient_predivide_factor != 1.0):
            with tf.name_scope(self.name + "_Allreduce"):
                for i in shared:
                    grads[i] = self._reduce_one(grads[i], variables[i])
        elif size > 1 or self.op != Average or self.gradient_predivide_factor != 1.0:
            with tf.name_scope(self.name):
                for k, group in enumerate(self._split(shared, variables)):
                    name = self.name if k == 0 else f"{self.name}.group{k}"
                    for i, result in zip(group, self._reduce_group([grads[i] for i in group],
                                                                   name)):
                        grads[i] = result
        if len(shared) > 1 and not tf.executing_eagerly():
            reduced = _after_all([grads[i] for i in shared])
            for i, result in zip(shared, reduced):
                grads[i] = result
        return self.scale_local(list(zip(grads, variables)))

    def _size(self) -> int:
        return basics.size() if self.process_set is None else self.process_set.size()

    def scale_local(self, grads_and_vars: list) -> list:
        """The pairs, gradients of local variables divided by size() (with
        scale_local_gradients and more than one rank)."""
        if not (self.scale_local_gradients and self.local) or self._size() == 1:
            return grads_and_vars
        size = self._size()
        return [(collectives.scaled(g, 1.0 / size) if g is not None and v.ref() in self.local
                 else g, v) for g, v in grads_and_vars]

    def _split(self, indices: list, variables: list) -> list:
        if not indices:
            return []
        if self.groups is None:
            return [indices]
        if not isinstance(self.groups, list):
            count = min(int(self.groups), len(indices))
            per, extra = divmod(len(indices), count)
            bounds = [k * per + min(k, extra) for k in range(count + 1)]
            return [indices[bounds[k]:bounds[k + 1]] for k in range(count)]
        position = {variables[i].ref(): i for i in indices}
        split, placed = [], set()
        for group in self.groups:
            members = [position[v.ref()] for v in group
                       if v.ref() in position and position[v.ref()] not in placed]
            placed.update(members)
            if members:
                split.append(members)
        return split + [[i] for i in indices if i not in placed]

    def _reduce_group(self, grads: list, name: str) -> list:
        prescale = 1.0 / self.gradient_predivide_factor
        postscale = self.gradient_predivide_factor
        dense = [k for k, g in enumerate(grads) if not isinstance(g, tf.IndexedSlices)]
        results = list(grads)
        reduced = collectives.grouped_allreduce([grads[k] for k in dense], op=self.op, name=name,
                                        compression=self.compression,
                                        prescale_factor=prescale, postscale_factor=postscale,
                                        process_set=self.process_set)
        for k, result in zip(dense, reduced):
            results[k] = result
        for k, grad in enumerate(grads):
            if isinstance(grad, tf.IndexedSlices):
                results[k] = self._reduce_sparse(grad, f"{name}.sparse.{k}")
        return results

    def _scales(self) -> dict:
        # Average divides by size() itself; predivision splits that division around the sum.
        return {"prescale_factor": 1.0 / self.gradient_predivide_factor,
                "postscale_factor": self.gradient_predivide_factor}

    def _reduce_sparse(self, grad: tf.IndexedSlices, name: str) -> tf.IndexedSlices:
        """Allgathered values and indices (compressed values): the result stays sparse."""
        values, ctx = self.compression.compress(grad.values)
        result = collectives.allreduce(tf.IndexedSlices(values, grad.indices, grad.dense_shape),
                                       op=self.op, name=name, process_set=self.process_set,
                                       **self._scales())
        return tf.IndexedSlices(self.compression.decompress(result.values, ctx), result.indices,
                                result.dense_shape)

    def _reduce_one(self, grad: Any, var: Any) -> Any:
        var_name = var.name if tf.executing_eagerly() else var.op.name
        name = f"{self.name}_Allreduce_{var_name.split(':')[0]}"
        if isinstance(grad, tf.IndexedSlices):
            return self._reduce_sparse(grad, name)
        return collectives.allreduce(grad, op=self.op, name=name, compression=self.compression,
                                     process_set=self.process_set, **self._scales())

