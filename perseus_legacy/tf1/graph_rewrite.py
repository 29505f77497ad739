"""Rewrites a built tf.compat.v1 graph so that every optimizer update uses rank-averaged gradients.

`distribute_graph()` is what `SyncReplicasHook` runs in `begin()`: the model code keeps its plain
optimizer, and the graph it built is changed so that the gradient input of each update op comes
through a Perseus collective instead of straight from this rank's backward pass.

What counts as an optimizer update:

- dense apply ops (`ApplyGradientDescent`, `ResourceApplyAdam`, ...; any op type starting with
  `Apply` or `ResourceApply`): the input named `grad` (or `delta`) in the op's definition is
  replaced by its allreduce.
- sparse apply ops (`SparseApply*`, `ResourceSparseApply*`) and the scatter ops that optimizers
  build inside their `update_<variable>` name scope for a sparse gradient (SGD's
  `ResourceScatterAdd`, Adam's slot scatters). The gradient's values and indices are allgathered
  (values divided by size() for Average): every rank then holds the gradient of the global
  batch, rows in rank order. When the optimizer first merges duplicate indices
  (`Unique` + `UnsortedSegmentSum`, as the TF1 optimizers do), the raw values and indices going
  into that merge are gathered, so that duplicates across ranks are merged too; otherwise the
  op's own `grad`/`updates` and `indices` inputs are gathered (scatter add/sub are linear in
  their updates, so gathering the scaled updates equals gathering the gradient).

Every update op of a step waits for every collective of that step (through one barrier op per
step): a variable is updated only once every gradient of the step is reduced. When a rank is
lost in the middle of a step, some collectives fail and others may have completed; no variable
is then updated, and each survivor holds the variables of the last completed step (what
perseus_legacy.tf1.survivor saves). The update ops of one step are those under one optimizer
apply's name scope (the part of their name before `update...`).

After the rewrite, every other update of model state is checked (perseus_legacy.tf1.per_rank):
a write to a global variable whose value comes from this rank's data without a collective
(KMeans, LinearSDCA, a model_fn's own assign ops) raises PerRankUpdateError, unless it is of a
kind that is per rank by design (global step, batch-norm statistics) or declared with
`per_rank_update()`.

A gradient that already comes from a Perseus collective (a graph built with
`DistributedOptimizer`, or rewritten before) is left alone, so rewriting is idempotent and never
averages twice. The collectives are named after the update op, so ranks that built the same
graph agree on their names.
"""

from __future__ import annotations

import re
from typing import Any

import tensorflow as tf

from perseus_legacy.common import basics
from perseus_legacy.common.basics import Average
from perseus_legacy.tensorflow import collectives
from perseus_legacy.tf1 import per_rank

_COLLECTIVES = frozenset({"PerseusAllreduce", "PerseusAllgather", "PerseusBroadcast"})
# Ops a collective's output may pass through on its way to an update (identity, fp16
# decompression, the Average scaling of gathered sparse values).
_PASS_THROUGH = frozenset({"Identity", "Cast", "Mul", "RealDiv", "Neg"})
_DENSE_PREFIXES = ("Apply", "ResourceApply")
_SPARSE_PREFIXES = ("SparseApply", "ResourceSparseApply")
# Scatter ops linear in `updates`: their updates may be gathered directly.
_LINEAR_SCATTERS = frozenset({"ScatterAdd", "ScatterSub", "ResourceScatterAdd",
                              "ResourceScatterSub", "ScatterNdAdd", "ScatterNdSub",
                              "ResourceScatterNdAdd", "ResourceScatterNdSub"})
_SCATTER = re.compile(r"^(Resource)?Scatter")
_UPDATE_SCOPE = re.compile(r"(^|/)update_[^/]*/")
_SCOPE = "PerseusSync"


class GraphRewriteError(ValueError):
    """An optimizer update op of the graph could not be routed through a collective."""


def _is_update_op(op: tf.Operation) -> bool:
    if op.type.startswith(_SPARSE_PREFIXES) or op.type.startswith(_DENSE_PREFIXES):
        return True
    return bool(_SCATTER.match(op.type)) and bool(_UPDATE_SCOPE.search(op.name))


def _input_index(op: tf.Operation, *arg_names: str) -> int | None:
    """Index in op.inputs of the first input argument called one of `arg_names`."""
    index = 0
    for arg in op.op_def.input_arg:
        if arg.number_attr or arg.type_list_attr:
            return None  # list arguments shift the indices; no update op has them
        if arg.name in arg_names:
            return index
        index += 1
    return None


def _from_collective(tensor: tf.Tensor, depth: int = 4) -> bool:
    """Whether `tensor` is (a pass-through op away from) a Perseus collective's output."""
    op = tensor.op
    if op.type in _COLLECTIVES:
        return True
    if depth == 0 or op.type not in _PASS_THROUGH:
        return False
    return any(_from_collective(t, depth - 1) for t in op.inputs)


def _dedup_sources(indices: tf.Tensor) -> tuple | None:
    """(UnsortedSegmentSum op, Unique op) when `indices` are the unique indices of a merge."""
    unique = indices.op
    if unique.type not in ("Unique", "UniqueV2") or indices.value_index != 0:
        return None
    sums = [c for c in unique.outputs[1].consumers()
            if c.type == "UnsortedSegmentSum" and c.inputs[1].name == unique.outputs[1].name]
    return (sums[0], unique) if len(sums) == 1 else None


def _check_update_input() -> None:
    if not callable(getattr(tf.Operation, "_update_input", None)):
        raise GraphRewriteError(
            f"this TensorFlow ({tf.__version__}) has no Operation._update_input, which "
            "distribute_graph() needs to rewire the graph; use "
            "perseus_legacy.DistributedOptimizer instead")


def _update_input(op: tf.Operation, index: int, tensor: tf.Tensor) -> None:
    op._update_input(index, tensor)  # TF internal; presence checked by _check_update_input


class _Rewriter:
    def __init__(self, graph: tf.Graph, op: int) -> None:
        self.graph = graph
        self.op = op
        self.reduced: dict = {}  # source tensor ref(s) -> collective result, built once
        self.rewritten = 0
        self.steps: dict = {}  # step key -> ([rewired update ops], [collective result ops])

    def _rewired(self, update_op: tf.Operation, *results: tf.Tensor) -> None:
        updates, collective_ops = self.steps.setdefault(_step_of(update_op), ([], []))
        updates.append(update_op)
        collective_ops.extend(r.op for r in results if r.op not in collective_ops)
        self.rewritten += 1

    def wait_for_whole_steps(self) -> None:
        """Makes every rewired update op wait for every collective of its step.

        Outside control flow through one barrier op per step (2N control edges, not N*N: with
        ~400 gradients that is ~160,000 edges the executor would walk every step); inside a
        loop or cond, where an op made here would sit outside the update's frame, directly."""
        for key, (updates, collective_ops) in self.steps.items():
            outside = [c for c in collective_ops if c._get_control_flow_context() is None]
            barrier = None
            for update_op in updates:
                context = update_op._get_control_flow_context()  # TF internal, as _update_input
                if context is None and len(outside) > 1:
                    if barrier is None:
                        with self.graph.control_dependencies(outside):
                            barrier = tf.no_op(name=f"{_SCOPE}/{key or 'step'}/all_reduced")
                    waits = [barrier]
                else:
                    waits = [c for c in collective_ops
                             if c._get_control_flow_context() is context]
                waits = [w for w in waits if w not in update_op.control_inputs]
                if waits:
                    update_op._add_control_inputs(waits)

    def _collective_name(self, update_op: tf.Operation) -> str:
        return f"{_SCOPE}/{update_op.name}"

    def _device(self, tensor: tf.Tensor) -> Any:
        return self.graph.device(tensor.op.device or None)

    def dense(self, update_op: tf.Operation) -> None:
        index = _input_index(update_op, "grad", "delta")
        grad = update_op.inputs[index]
        if _from_collective(grad):
            return
        key = ("dense", grad.ref())
        if key not in self.reduced:
            with self._device(grad):
                self.reduced[key] = collectives.allreduce(grad, op=self.op,
                                                  name=self._collective_name(update_op))
        _update_input(update_op, index, self.reduced[key])
        self._rewired(update_op, self.reduced[key])

    def _gather(self, update_op: tf.Operation, values: tf.Tensor, indices: tf.Tensor) -> tuple:
        key = ("sparse", values.ref(), indices.ref())
        if key not in self.reduced:
            with self._device(values):
                gathered = collectives.allreduce(tf.IndexedSlices(values, indices), op=self.op,
                                         name=self._collective_name(update_op))
            self.reduced[key] = (gathered.values, gathered.indices)
        return self.reduced[key]

    def sparse(self, update_op: tf.Operation) -> None:
        values_index, indices_index = _sparse_indices(update_op)
        indices = update_op.inputs[indices_index]
        merge = _dedup_sources(indices)
        if merge is not None:  # gather the raw slices going into the duplicate merge
            segment_sum, unique = merge
            raw_values, raw_indices = segment_sum.inputs[0], unique.inputs[0]
            if _from_collective(raw_indices) or _from_collective(raw_values):
                return  # already gathered (e.g. by another update op of the same merge)
            values, gathered_indices = self._gather(update_op, raw_values, raw_indices)
            _update_input(segment_sum, 0, values)
            _update_input(unique, 0, gathered_indices)
            self._rewired(update_op, values, gathered_indices)
            return
        values = update_op.inputs[values_index]
        if _from_collective(indices) or _from_collective(values):
            return
        gathered_values, gathered_indices = self._gather(update_op, values, indices)
        _update_input(update_op, values_index, gathered_values)
        _update_input(update_op, indices_index, gathered_indices)
        self._rewired(update_op, gathered_values, gathered_indices)


def _step_of(update_op: tf.Operation) -> str:
    """The name scope of the optimizer apply that built `update_op` (one step's updates)."""
    parts = update_op.name.split("/")
    for i, part in enumerate(parts):
        if part.startswith("update"):
            return "/".join(parts[:i])
    return ""


def _sparse_indices(update_op: tf.Operation) -> tuple:
    """(index of the gradient values / scatter updates input, index of the indices input)."""
    scatter = not update_op.type.startswith(_SPARSE_PREFIXES)
    return (_input_index(update_op, "updates" if scatter else "grad"),
            _input_index(update_op, "indices"))


def _problem(update_op: tf.Operation) -> str | None:
    """Why `update_op` cannot be rewritten, or None."""
    if update_op.type.startswith(_DENSE_PREFIXES):
        if _input_index(update_op, "grad", "delta") is None:
            return f"{update_op.name} ({update_op.type}: no grad/delta input)"
        return None
    values_index, indices_index = _sparse_indices(update_op)
    if values_index is None or indices_index is None:
        return f"{update_op.name} ({update_op.type}: no grad/updates and indices inputs)"
    if (_SCATTER.match(update_op.type) and update_op.type not in _LINEAR_SCATTERS
            and _dedup_sources(update_op.inputs[indices_index]) is None):
        return (f"{update_op.name} ({update_op.type} is not linear in its updates, and its "
                "indices do not come from merging a gradient's duplicate indices)")
    return None


def _update_ops(graph: tf.Graph) -> list:
    return [op for op in graph.get_operations() if _is_update_op(op)]


def distribute_graph(graph: tf.Graph | None = None, op: int = Average) -> int:
    """Routes the gradient input of every optimizer update op of `graph` through a collective.

    `graph` defaults to the default graph and must not be finalized; call this after the train
    op is built and before the Session runs it (SyncReplicasHook does it in `begin()`). Every
    rank must have built the same graph. Returns how many update ops were rewritten: 0 with one
    rank, and 0 for a graph whose gradients already come from Perseus collectives
    (DistributedOptimizer, or a second call). Raises GraphRewriteError naming every update op
    it recognises but cannot rewrite (the graph is then left unchanged). Raises
    PerRankUpdateError (after the rewrite) when another op updates model state from this rank's
    data without a collective (see perseus_legacy.tf1.per_rank).
    """
    basics.require_initialized("distribute_graph()")
    collectives._check_op(op)
    graph = graph if graph is not None else tf.compat.v1.get_default_graph()
    if basics.size() == 1:
        return 0
    if graph.finalized:
        raise RuntimeError("distribute_graph(): the graph is finalized; call it before the "
                           "session is created (SyncReplicasHook does it in begin())")
    _check_update_input()
    update_ops = _update_ops(graph)
    problems = [p for p in map(_problem, update_ops) if p is not None]
    if problems:  # checked before anything changes
        raise GraphRewriteError(
            "distribute_graph() cannot average the gradient of these optimizer update ops: "
            + "; ".join(problems)
            + ". Wrap the optimizer in perseus_legacy.DistributedOptimizer instead.")
    rewriter = _Rewriter(graph, op)
    with graph.as_default(), graph.name_scope(None), graph.control_dependencies(None):
        for update_op in update_ops:
            if update_op.type.startswith(_DENSE_PREFIXES):
                rewriter.dense(update_op)
            else:
                rewriter.sparse(update_op)
        rewriter.wait_for_whole_steps()
    per_rank.check_updates(graph, basics.rank(), basics.size())
    return rewriter.rewritten
