"""Optimizer wrappers for tf.compat.v1 optimizers whose gradients are reduced over all ranks.

DistributedOptimizer is Horovod's; SyncReplicasOptimizer is a drop-in for
`tf.compat.v1.train.SyncReplicasOptimizer` that runs on allreduce instead of parameter servers.
Both may accumulate gradients locally over several backward passes before one reduction and one
update (`_accumulate_then_apply`). With op=Adasum, DistributedOptimizer instead applies each
rank's own gradients and combines the variables' changes (`_AdasumDelta`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import tensorflow as tf

from perseus_legacy.common import basics
from perseus_legacy.common.basics import Adasum, Average
from perseus_legacy.tensorflow import collectives
from perseus_legacy.tensorflow.accumulation import GradientAccumulator
from perseus_legacy.tensorflow.compression import Compression
from perseus_legacy.tensorflow.reduction import GradientReducer, resolve_groups
from perseus_legacy.tf1.hooks import SyncReplicasHook


def _accumulate_then_apply(grads_and_vars: list, passes: int, scale: float,
                           reduce_and_apply: Callable[[list], Any], name: str) -> Any:
    """Adds this pass's gradients to local accumulators; every `passes`-th call, reduces
    `scale` x the accumulated sums and applies them (through `reduce_and_apply`), then clears.

    Accumulators and the pass counter are local variables (initialised by the Scaffold's local
    init op, not checkpointed, never broadcast): passes accumulated when the job stops are lost.
    """
    if tf.executing_eagerly():
        raise NotImplementedError(
            f"{name}: accumulating gradients over several backward passes needs a graph "
            "(tf.compat.v1 Session, MonitoredTrainingSession, Estimator); eagerly, use one pass "
            "per step")
    local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
    with tf.compat.v1.name_scope(None), tf.compat.v1.name_scope(f"{name}_accumulation") as scope:
        pass

    def make_local(initial: Callable[[], tf.Tensor], variable_name: str) -> Any:
        with tf.compat.v1.name_scope(scope):
            return tf.compat.v1.Variable(initial, trainable=False, name=variable_name,
                                         collections=local, use_resource=True)

    accumulator = GradientAccumulator(make_local, keep_sparse=True)
    count = accumulator.add(grads_and_vars)

    def apply_now() -> Any:
        totals = accumulator.totals(scale)
        reads = [t.values if isinstance(t, tf.IndexedSlices) else t for t, _ in totals]
        with tf.control_dependencies(reads):
            applied = reduce_and_apply(totals)
        with tf.control_dependencies([applied]):
            return accumulator.clear()

    return tf.cond(count >= passes, apply_now, tf.no_op, name=f"{name}_apply_every_{passes}")


class _AdasumDelta:
    """Horovod's Adasum optimizer, as its documentation describes it: each rank applies its own
    gradients with the wrapped optimizer, then every `passes`-th step each variable's change
    since the last combination is replaced by the Adasum of every rank's change.

    The start of each period is a copy of the variable (a local variable when passes > 1: not
    checkpointed, never broadcast). The wrapped optimizer's slots stay per rank, as in Horovod.
    """

    def __init__(self, name: str, passes: int, compression: Any, process_set: Any) -> None:
        self.name = name
        self.passes = passes
        self.compression = compression
        self.process_set = process_set

    def apply(self, variables: list, apply_locally: Callable[[], Any]) -> Any:
        """Runs `apply_locally` (the wrapped optimizer's update), then combines `variables`."""
        if tf.executing_eagerly():
            if self.passes > 1:
                raise NotImplementedError(
                    f"{self.name}: op=Adasum with backward_passes_per_step > 1 needs a graph "
                    "(tf.compat.v1 Session, MonitoredTrainingSession, Estimator)")
            starts = [tf.raw_ops.DeepCopy(x=v.read_value()) for v in variables]
            result = apply_locally()
            self._combine(variables, starts)
            return result
        if self.passes == 1:
            starts = [tf.raw_ops.DeepCopy(x=v.read_value()) for v in variables]
            with tf.control_dependencies(starts):
                applied = apply_locally()
            with tf.control_dependencies([applied]):
                return self._combine(variables, starts)
        local = [tf.compat.v1.GraphKeys.LOCAL_VARIABLES]
        with tf.compat.v1.name_scope(None), tf.compat.v1.name_scope(f"{self.name}_adasum"):
            counter = tf.compat.v1.Variable(0, dtype=tf.int32, trainable=False, name="passes",
                                            collections=local, use_resource=True)
            starts = [tf.compat.v1.Variable(tf.zeros(v.shape, v.dtype.base_dtype),
                                            trainable=False, collections=local,
                                            use_resource=True,
                                            name=v.op.name.replace("/", "_") + "_start")
                      for v in variables]

        def remember_starts() -> Any:
            return tf.group(*[s.assign(v.read_value()) for s, v in zip(starts, variables)])

        remembered = tf.cond(tf.equal(counter, 0), remember_starts, tf.no_op)
        with tf.control_dependencies([remembered]):
            applied = apply_locally()
        with tf.control_dependencies([applied]):
            count = counter.assign_add(1)

        def combine() -> Any:
            combined = self._combine(variables, [s.read_value() for s in starts])
            with tf.control_dependencies([combined]):
                return counter.assign(0).op

        return tf.cond(count >= self.passes, combine, tf.no_op,
                       name=f"{self.name}_adasum_every_{self.passes}")

    def _combine(self, variables: list, starts: list) -> Any:
        if not variables:
            return tf.no_op()
        deltas = [v.read_value() - s for v, s in zip(variables, starts)]
        combined = collectives.adasum_grouped_allreduce(
            deltas, self.compression, name=f"{self.name}_Adasum", process_set=self.process_set,
            what=f"{self.name} (op=Adasum)")
        return tf.group(*[v.assign(s + c) for v, s, c in zip(variables, starts, combined)])


def _is_keras_optimizer(optimizer: Any) -> bool:
    """Whether `optimizer`'s class comes from a Keras package (tf-keras, Keras 2 or 3), without
    importing Keras."""
    return any(cls.__module__.split(".")[0] in ("keras", "tf_keras")
               for cls in type(optimizer).__mro__)


def _keras_distributed_optimizer(*args: Any, **kwargs: Any) -> Any:
    """perseus_legacy.keras.DistributedOptimizer with DistributedOptimizer's arguments."""
    bound = inspect.signature(DistributedOptimizer.__init__).bind(None, *args, **kwargs)
    arguments = dict(bound.arguments)
    del arguments["self"]
    arguments.pop("use_locking", None)  # Keras optimizers have no such argument
    from perseus_legacy import keras as perseus_keras  # Keras is imported only when asked for

    return perseus_keras.DistributedOptimizer(**arguments)


class DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A `tf.compat.v1.train.Optimizer` whose gradients are averaged (by default) over all ranks.

    `compute_gradients` returns the wrapped optimizer's gradients reduced with `op` over every
    rank, so `minimize`/`apply_gradients` take the same step on every rank. Every rank must
    build the same trainable variables: their names name the collectives. Given a Keras
    optimizer, it returns `perseus_legacy.keras.DistributedOptimizer(optimizer, ...)`, as
    Horovod does.

    Args:
      optimizer: the tf.compat.v1.train.Optimizer to wrap (or a Keras 2 optimizer, see above).
      name: the optimizer's name, which also names the collectives (default
        "Distributed" + the wrapped class's name).
      use_locking: passed to tf.compat.v1.train.Optimizer.
      device_dense: ignored (Horovod's): every kernel runs on the CPU.
      device_sparse: ignored, likewise.
      compression: `Compression.none`, or `Compression.fp16` to send float gradients as
        float16.
      sparse_as_dense: convert sparse gradients (`tf.IndexedSlices`, e.g. of an embedding
        lookup) to dense tensors before reducing; otherwise they are allgathered and stay
        sparse.
      backward_passes_per_step: k > 1: `compute_gradients` returns this rank's gradients and
        `apply_gradients` accumulates them, reducing and applying only every k-th call (a
        graph is needed).
      op: Average (default), Sum, or Adasum: each rank applies its own gradients and the
        variables' changes are combined by Adasum every `backward_passes_per_step`-th step
        (see _AdasumDelta).
      gradient_predivide_factor: f (op=Average only) scales gradients by 1/f before the sum
        and f/size() after it.
      average_aggregated_gradients: with backward_passes_per_step=k, apply the mean of the k
        passes instead of their sum (as in Horovod).
      num_groups: Horovod's deprecated spelling of `groups`.
      groups: validated and otherwise ignored: each gradient is its own collective, and the
        runtime fuses them.
      process_set: reduce over this ProcessSet's ranks only (default: every rank).
      scale_local_gradients: divide the gradients of variables given to
        `register_local_var` (which are not reduced) by size(), as in Horovod.

    Raises:
      TypeError: `optimizer` is neither a tf.compat.v1 nor a Keras 2 optimizer.
      ValueError: backward_passes_per_step < 1, op=Adasum with
        average_aggregated_gradients, a predivide factor with an op other than Average, or
        bad `groups`.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        given = args[0] if args else kwargs.get("optimizer")
        if cls is DistributedOptimizer and _is_keras_optimizer(given):
            return _keras_distributed_optimizer(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, name: str | None = None,
                 use_locking: bool = False, device_dense: str = "", device_sparse: str = "",
                 compression: Any = Compression.none, sparse_as_dense: bool = False,
                 backward_passes_per_step: int = 1, op: int = Average,
                 gradient_predivide_factor: float = 1.0,
                 average_aggregated_gradients: bool = False, num_groups: int = 0,
                 groups: Any = None, process_set: Any = None,
                 scale_local_gradients: bool = True) -> None:
        if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
            keras = " or a Keras 2 optimizer" if type(self) is DistributedOptimizer else ""
            raise TypeError(
                f"{type(self).__name__} wraps a tf.compat.v1.train.Optimizer{keras}, got "
                f"{type(optimizer).__module__}.{type(optimizer).__name__}")
        if int(backward_passes_per_step) < 1:
            raise ValueError(
                f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if op == Adasum and average_aggregated_gradients:
            raise ValueError("op=Adasum does not take average_aggregated_gradients=True (as in "
                             "Horovod): it combines the variables' changes, not gradients")
        resolve_groups(num_groups, groups)  # validated; every gradient is its own collective
        if name is None:
            name = "Distributed" + type(optimizer).__name__
        super().__init__(use_locking=use_locking, name=name)
        self._optimizer = optimizer
        self._reducer = GradientReducer(
            self._name, compression, sparse_as_dense, op, gradient_predivide_factor,
            scale_local_gradients=scale_local_gradients, process_set=process_set,
            one_per_variable=True)
        self._passes = int(backward_passes_per_step)
        self._average_passes = average_aggregated_gradients
        self._adasum = None
        if op == Adasum:
            self._adasum = _AdasumDelta(self._name, self._passes, compression, process_set)

    def register_local_var(self, var: Any) -> None:
        """Keeps `var`'s gradient on this rank: not reduced (divided by size() with
        scale_local_gradients). Call it before compute_gradients()."""
        self._reducer.register_local(var)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's (gradient, variable) pairs, gradients reduced over all ranks
        (with backward_passes_per_step > 1: this rank's, reduced later by apply_gradients;
        with op=Adasum: this rank's, applied as they are)."""
        grads_and_vars = self._optimizer.compute_gradients(*args, **kwargs)
        basics.require_initialized(f"{self._name}.compute_gradients()")
        if self._adasum is not None:
            return self._reducer.scale_local(grads_and_vars)
        if self._passes > 1:
            return grads_and_vars
        return self._reducer.reduce(grads_and_vars)

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: str | None = None) -> Any:
        """Applies the reduced gradients with the wrapped optimizer (every k-th call with
        backward_passes_per_step=k, the global step advancing only then). With op=Adasum the
        wrapped optimizer applies this rank's gradients on every call (the global step
        advancing each time) and the variables' changes are combined every k-th call."""
        if self._adasum is not None:
            grads_and_vars = list(grads_and_vars)
            local = self._reducer.local
            shared = [v for g, v in grads_and_vars if g is not None and v.ref() not in local]
            return self._adasum.apply(shared, lambda: self._optimizer.apply_gradients(
                grads_and_vars, global_step, name))
        if self._passes == 1:
            return self._optimizer.apply_gradients(grads_and_vars, global_step, name)
        scale = 1.0 / self._passes if self._average_passes else 1.0
        return _accumulate_then_apply(
            list(grads_and_vars), self._passes, scale,
            lambda total: self._optimizer.apply_gradients(self._reducer.reduce(total),
                                                          global_step, name),
            self._name)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's slot variable."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's slot names."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> list:
        """The wrapped optimizer's variables (slots, beta powers, ...)."""
        return self._optimizer.variables(*args, **kwargs)


class SyncReplicasOptimizer(DistributedOptimizer):
    """`tf.compat.v1.train.SyncReplicasOptimizer` on allreduce: no parameter servers, no queues.

    Every global step applies the average of `replicas_to_aggregate` gradients. Each rank counts
    as one replica. Backup workers (fewer replicas to aggregate than replicas) and counts that
    are not a multiple of the number of ranks are refused: allreduce waits for every rank.

    Args:
      opt: the tf.compat.v1.train.Optimizer to wrap.
      replicas_to_aggregate: gradients averaged per global step; default size(). k * size()
        (k > 1) averages k backward passes of every rank (the global step advances every k-th
        run of the train op).
      total_num_replicas: must be None or size().
      variable_averages: not supported (must be None).
      variables_to_average: not supported (must be None).
      use_locking: passed to tf.compat.v1.train.Optimizer.
      name: the optimizer's name.

    Raises:
      NotImplementedError: variable averages were asked for.
      ValueError: total_num_replicas is not size(), or replicas_to_aggregate is less than
        size() or not a multiple of it.
    """

    def __init__(self, opt: tf.compat.v1.train.Optimizer, replicas_to_aggregate: int | None = None,
                 total_num_replicas: int | None = None, variable_averages: Any = None,
                 variables_to_average: Any = None, use_locking: bool = False,
                 name: str = "sync_replicas") -> None:
        basics.require_initialized("SyncReplicasOptimizer()")
        size, rank = basics.size(), basics.rank()
        where = f"SyncReplicasOptimizer on rank {rank} of {size}"
        if variable_averages is not None or variables_to_average is not None:
            raise NotImplementedError(
                f"{where}: variable_averages is not supported; build the "
                "ExponentialMovingAverage after the train op yourself (every rank holds the "
                "same variables, so rank 0's averages are everyone's)")
        total = size if total_num_replicas is None else int(total_num_replicas)
        if total != size:
            raise ValueError(
                f"{where}: total_num_replicas={total_num_replicas}, but the job has {size} "
                "ranks; each rank is one replica (leave total_num_replicas=None)")
        aggregate = size if replicas_to_aggregate is None else int(replicas_to_aggregate)
        if aggregate < size:
            raise ValueError(
                f"{where}: replicas_to_aggregate={replicas_to_aggregate} < {size} replicas asks "
                "for backup workers (the slowest replicas' gradients dropped each step); "
                "allreduce waits for every rank, so use replicas_to_aggregate=None "
                f"(= {size}) or a multiple of it to accumulate several passes per rank")
        if aggregate % size:
            raise ValueError(
                f"{where}: replicas_to_aggregate={replicas_to_aggregate} is not a multiple of "
                f"the {size} ranks; k * {size} accumulates k backward passes on every rank")
        super().__init__(opt, name=name, use_locking=use_locking,
                         backward_passes_per_step=aggregate // size,
                         average_aggregated_gradients=True)
        self._replicas_to_aggregate = aggregate
        self._total_num_replicas = total

    def get_init_tokens_op(self, num_tokens: int = -1) -> Any:
        """No tokens exist (replicas never run ahead of each other): a no-op."""
        return tf.no_op(name="sync_replicas_init_tokens")

    def make_session_run_hook(self, is_chief: bool, num_tokens: int = -1) -> Any:
        """The hook every rank passes to its MonitoredTrainingSession: it broadcasts rank 0's
        variables after the session is created (or restored) and keeps ranks stopping together.
        `is_chief` and `num_tokens` are accepted for compatibility; rank 0 is the chief."""
        return SyncReplicasHook()
