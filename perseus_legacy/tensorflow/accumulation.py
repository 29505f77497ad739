"""GradientAccumulator: this rank's sums of gradients over backward passes, the one accumulator of
the TF1 DistributedOptimizer and the Keras DistributedOptimizer (backward_passes_per_step > 1).

The caller decides where the buffers live (`make_variable`): TF1 graphs use local variables
(initialised by the Scaffold's local init op, not checkpointed, never broadcast); Keras uses
plain tf.Variables that no checkpoint tracks. Either way, passes summed when the job stops are
lost.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

# make_variable(initial_value, name) -> a non-trainable variable; `initial_value` is a function
# returning the tensor, so that it can be called where the variable is made (tf.init_scope).
VariableFactory = Callable[[Callable[[], tf.Tensor], str], Any]


def _name_of(var: Any) -> str:
    return var.name.split(":")[0].replace("/", "_")


class _Sum:
    """One variable's sum. Kept sparse: the rows the sparse gradients touched are remembered,
    so the total is a tf.IndexedSlices of those rows."""

    def __init__(self, var: Any, sparse: bool, make_variable: VariableFactory) -> None:
        self.var = var
        self.sparse = sparse
        name = _name_of(var)
        shape, dtype = var.shape, var.dtype.base_dtype
        self.total = make_variable(lambda: tf.zeros(shape, dtype), name)
        self.touched = make_variable(lambda: tf.zeros(shape[:1], tf.int32), name + "_rows") \
            if sparse else None

    def add(self, grad: Any) -> Any:
        if not self.sparse:
            return self.total.assign_add(tf.convert_to_tensor(grad))
        ones = tf.ones_like(grad.indices, tf.int32)
        return tf.group(self.total.scatter_add(grad),
                        self.touched.scatter_update(tf.IndexedSlices(ones, grad.indices)))

    def read(self, scale: float) -> Any:
        scale = tf.cast(scale, self.total.dtype)
        if not self.sparse:
            return self.total.read_value() * scale
        rows = tf.cast(tf.reshape(tf.where(self.touched.read_value() > 0), [-1]), tf.int32)
        return tf.IndexedSlices(tf.gather(self.total.read_value(), rows) * scale, rows,
                                tf.shape(self.total, out_type=tf.int64))

    def clear(self) -> list:
        cleared = [self.total.assign(tf.zeros_like(self.total))]
        if self.sparse:
            cleared.append(self.touched.assign(tf.zeros_like(self.touched)))
        return cleared


class GradientAccumulator:
    """Sums of (gradient, variable) pairs over backward passes, and the number of passes.

    With `keep_sparse`, a sparse gradient (tf.IndexedSlices) is summed into a dense buffer and
    the rows it touched are remembered, so the total stays sparse: optimizers with lazy sparse
    updates (Momentum, Adam) then update exactly the rows one step on all the passes' data
    would. Otherwise sparse gradients are summed densely. Buffers are made by `make_variable`
    the first time a variable's gradient is added.
    """

    def __init__(self, make_variable: VariableFactory, keep_sparse: bool) -> None:
        self._make_variable = make_variable
        self._keep_sparse = keep_sparse
        self._sums: dict = {}  # var.ref() -> _Sum
        self._order: list = []  # the variables of the last add(), in order
        self.count: Any = None

    def add(self, grads_and_vars: list) -> tf.Tensor:
        """Adds one pass's gradients (None gradients skipped); returns the number of passes
        summed so far, this one included (after the additions)."""
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if self.count is None:
            self.count = self._make_variable(lambda: tf.constant(0, tf.int64), "passes")
        for grad, var in pairs:
            if var.ref() not in self._sums:
                sparse = self._keep_sparse and isinstance(grad, tf.IndexedSlices)
                self._sums[var.ref()] = _Sum(var, sparse, self._make_variable)
        self._order = [v for _, v in pairs]
        added = [self._sums[v.ref()].add(g) for g, v in pairs]
        with tf.control_dependencies(added):
            return self.count.assign_add(1)

    def totals(self, scale: float = 1.0) -> list:
        """[(scale x the sum, variable)] of the variables of the last add(), in its order."""
        return [(self._sums[v.ref()].read(scale), v) for v in self._order]

    def clear(self) -> Any:
        """An op (eagerly: done now) that zeroes the sums and the pass count."""
        cleared = [c for v in self._order for c in self._sums[v.ref()].clear()]
        return tf.group(*cleared, self.count.assign(0))
