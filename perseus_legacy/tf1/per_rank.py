"""Finds the variable updates of a training graph that would leave each rank with its own model.

`distribute_graph()` averages the gradients that optimizers apply. A graph can also change model
state in other ways: an assign op whose value is computed from this rank's batch (KMeans'
cluster centers, LinearSDCA's weights, a model_fn's own `assign_add`). With several ranks such an
update makes every rank's variable the result of its own shard only, which one process on the
global batch never computes. `check_updates()` refuses those before the first step.

The rule. A value is *per rank* when it depends, through data inputs, on this rank's input: the
outputs of input pipelines (`IteratorGetNext` and friends, queue and reader ops), feeds
(placeholders, except Keras' learning phase) and `py_func`s; and, once written, the variables
holding such values. A Perseus allreduce, allgather or broadcast makes a value equal on every
rank again, so dependence stops there. Inside a TF1 `tf.cond` or while loop whose predicate is per
rank, every op of the branch is per rank too (their control input from the branch pivot).

A write to a global variable (model state: checkpointed, broadcast) whose written value is per
rank is refused, except:

- optimizer apply ops: only their gradient (and indices) count; `distribute_graph()` has routed
  those through a collective before this check runs. Learning rate and other hyperparameters
  (possibly fed) are taken to be the same on every rank.
- the global step, and batch-normalization moving statistics (`moving_mean`,
  `moving_variance`, renorm's statistics): per rank, as in Horovod (SyncBatchNormalization
  computes batch statistics over all ranks for Keras models).
- updates declared per rank on purpose with `per_rank_update()`: the op itself, or every update
  of a declared variable.

Local and metric variables are not model state and pass. A variable initializer passes (the
broadcast after the session starts overwrites it). Functional control flow (`If`, `While`,
function calls) is looked into one level deep: a write inside the function to a variable handle
passed in counts as a write by the call op, with the call's inputs as its value.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any

import tensorflow as tf

PER_RANK_COLLECTION = "perseus_legacy_per_rank_updates"

# Ops whose output is this rank's data.
_SOURCES = frozenset({
    "IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional",
    "MultiDeviceIteratorGetNextFromShard", "Placeholder", "PlaceholderV2",
    "PlaceholderWithDefault", "PyFunc", "PyFuncStateless", "EagerPyFunc",
    "QueueDequeue", "QueueDequeueV2", "QueueDequeueMany", "QueueDequeueManyV2",
    "QueueDequeueUpTo", "QueueDequeueUpToV2", "ReaderRead", "ReaderReadV2",
    "ReaderReadUpTo", "ReaderReadUpToV2",
})
_NOT_DATA = frozenset({"keras_learning_phase"})  # a mode flag, the same on every rank
# Ops whose output is the same on every rank whatever their input.
_EQUALIZERS = frozenset({"PerseusAllreduce", "PerseusGroupedAllreduce", "PerseusAllgather",
                         "PerseusBroadcast", "RestoreV2", "Restore", "RestoreSlice"})
_WRITE = re.compile(r"^(Resource)?((Sparse)?Apply|Scatter)|^Assign|StridedSliceAssign$")
_APPLY = re.compile(r"^(Resource)?(Sparse)?Apply")
_CALLS = frozenset({"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
                    "PartitionedCall", "StatefulPartitionedCall"})
_BATCH_NORM_STATISTICS = frozenset({"moving_mean", "moving_variance", "renorm_mean",
                                    "renorm_stddev", "renorm_mean_weight",
                                    "renorm_stddev_weight"})
# Canned tf.estimator models whose training updates variables without an optimizer, recognised
# by the variables they write, with what to use instead.
_CANNED = (
    (re.compile(r"(^|/)(clusters|clusters_updated|clusters_initialized|cluster_counts)$"),
     "tf.compat.v1.estimator.experimental.KMeans",
     "KMeans updates its cluster centers from each rank's own batch and is not synchronised "
     "(refused, not averaged). Cluster on one process (without perseus_legacy.run_config()), or "
     "write a model_fn whose cluster sums and counts go through perseus_legacy.allreduce "
     "(op=perseus_legacy.Sum) before the centers are assigned"),
    (re.compile(r"(?i)sdca"),
     "tf.compat.v1.estimator.experimental.LinearSDCA (LinearClassifier/LinearRegressor with "
     "optimizer=LinearSDCA)",
     "SDCA updates the weights from each rank's own examples and is not synchronised (refused, "
     "not averaged). Give the linear estimator a gradient optimizer instead (e.g. "
     "optimizer='Ftrl' or tf.compat.v1.train.FtrlOptimizer), which run_config() averages"),
)


class PerRankUpdateError(ValueError):
    """A training graph updates model state from this rank's data without a collective.

    Raised before the first step, on every rank (every rank builds the same graph). `updates`
    holds one (op name, variable name) pair per refused update.
    """

    def __init__(self, message: str, updates: list) -> None:
        super().__init__(message)
        self.updates = updates


def per_rank_update(update: Any) -> Any:
    """Declares `update` per rank on purpose: the check before training lets it through.

    `update` is a variable (every update of it is declared), an op or tensor (that update op),
    or a list of them. Each rank then keeps its own value: it is not averaged, and the variable
    still goes into rank 0's checkpoints (and is overwritten by rank 0's value when a session
    starts, as every global variable). Returns `update`, so it can wrap the expression that
    builds it. Only needed with several ranks (SyncReplicasHook, run_config(),
    distribute_graph()).
    """
    if isinstance(update, (list, tuple)):
        for item in update:
            per_rank_update(item)
        return update
    if isinstance(update, (tf.Operation, tf.Tensor)):
        graph = update.graph
    elif hasattr(update, "graph") and (hasattr(update, "handle") or hasattr(update, "op")):
        graph = update.graph
    else:
        raise TypeError(f"per_rank_update() takes a variable, an op or a tensor (or a list of "
                        f"them), not {type(update).__name__}: {update!r}")
    graph.add_to_collection(PER_RANK_COLLECTION, update)
    return update


def _variable_op(tensor: tf.Tensor, depth: int = 8) -> tf.Operation | None:
    """The VariableV2 / VarHandleOp that `tensor` (a ref or a resource handle) names."""
    op = tensor.op
    while depth and op.type in ("Identity", "RefIdentity", "Enter", "RefEnter") and op.inputs:
        op, depth = op.inputs[0].op, depth - 1
    if op.type in ("VariableV2", "Variable", "VarHandleOp"):
        return op
    return None


def _declared(graph: tf.Graph) -> tuple[set, set]:
    """(names of declared ops, names of declared variables' ops)."""
    ops, variables = set(), set()
    for item in graph.get_collection(PER_RANK_COLLECTION):
        if isinstance(item, tf.Operation):
            ops.add(item.name)
        elif isinstance(item, tf.Tensor):
            ops.add(item.op.name)
            var_op = _variable_op(item)
            if var_op is not None:
                variables.add(var_op.name)
        else:
            variables.add(item.op.name)
    return ops, variables


def _function_defs(graph: tf.Graph, op: tf.Operation) -> list:
    names = []
    for attr in op.node_def.attr.values():
        if attr.HasField("func"):
            names.append(attr.func.name)
        names.extend(f.name for f in attr.list.func)
    defs = []
    for name in names:
        function = graph._get_function(name)  # TF internal, stable since TF 1.x
        if function is not None:
            defs.append(function.cached_definition if hasattr(function, "cached_definition")
                        else function.definition)
    return defs


def _written_arguments(function_def: Any) -> set:
    """Indices of the function's arguments that a write op inside it updates."""
    args = {arg.name: i for i, arg in enumerate(function_def.signature.input_arg)}
    nodes = {node.name: node for node in function_def.node_def}
    written = set()
    for node in function_def.node_def:
        if not _WRITE.search(node.op) or not node.input:
            continue
        source = node.input[0].split(":")[0]
        for _ in range(8):  # through Identity nodes of the function body
            if source in args or source not in nodes or nodes[source].op != "Identity":
                break
            source = nodes[source].input[0].split(":")[0]
        if source in args:
            written.add(args[source])
    return written


class _Walk:
    """The per-rank values of one graph, and its refused updates."""

    def __init__(self, graph: tf.Graph) -> None:
        self.graph = graph
        self.global_vars = {}
        for var in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
            self.global_vars[var.op.name] = var
        step = tf.compat.v1.train.get_global_step(graph)
        self.global_step = step.op.name if step is not None else None
        self.initializers = set()
        for key in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
                    tf.compat.v1.GraphKeys.LOCAL_VARIABLES):
            for var in graph.get_collection(key):
                initializer = getattr(var, "initializer", None)
                if initializer is not None:
                    self.initializers.add(initializer.name)
        self.declared_ops, self.declared_vars = _declared(graph)
        self.parent: dict = {}  # per-rank op name -> the op it got it from (None: a source)
        self.refused: list = []  # (write op, variable op, source op)
        self.per_rank_vars: set = set()
        self.var_readers: dict = {}  # variable op name -> ops reading it
        self._written: dict = {}  # op name -> the variable ops it writes

    def _value_indices(self, op: tf.Operation) -> Any:
        """The input indices whose per-rank value makes this write per rank (None: all)."""
        if _APPLY.search(op.type):
            names = ("grad", "delta", "indices")
            index, wanted = 0, set()
            for arg in op.op_def.input_arg:
                if arg.number_attr or arg.type_list_attr:
                    return None
                if arg.name in names:
                    wanted.add(index)
                index += 1
            return wanted
        return None

    def _writes(self, op: tf.Operation) -> list:
        """The variable ops `op` writes (empty for a non-write)."""
        if op.name not in self._written:
            self._written[op.name] = self._find_writes(op)
        return self._written[op.name]

    def _find_writes(self, op: tf.Operation) -> list:
        if _WRITE.search(op.type) and op.inputs:
            var_op = _variable_op(op.inputs[0])
            return [var_op] if var_op is not None else []
        if op.type in _CALLS:
            offset = 1 if op.type in ("If", "StatelessIf", "Case", "StatelessCase") else 0
            found = []
            for function_def in _function_defs(self.graph, op):
                for arg in _written_arguments(function_def):
                    if offset + arg < len(op.inputs):
                        var_op = _variable_op(op.inputs[offset + arg])
                        if var_op is not None and var_op not in found:
                            found.append(var_op)
            return found
        return []

    def _allowed(self, op: tf.Operation, var_op: tf.Operation) -> bool:
        name = var_op.name
        return (name not in self.global_vars or name == self.global_step
                or name.rsplit("/", 1)[-1] in _BATCH_NORM_STATISTICS
                or op.name in self.declared_ops or name in self.declared_vars
                or op.name in self.initializers)

    def _reach(self, op: tf.Operation, parent: tf.Operation | None, queue: deque) -> None:
        if op.name in self.parent or op.type in _EQUALIZERS:
            return
        self.parent[op.name] = parent
        queue.append(op)

    def run(self) -> None:
        queue: deque = deque()
        for op in self.graph.get_operations():
            if op.type in _SOURCES and op.name not in _NOT_DATA:
                self._reach(op, None, queue)
            elif op.type in ("ReadVariableOp", "ResourceGather", "ResourceGatherNd"):
                var_op = _variable_op(op.inputs[0])
                if var_op is not None:
                    self.var_readers.setdefault(var_op.name, []).append(op)
        while queue:
            op = queue.popleft()
            self._spread(op, queue)

    def _spread(self, op: tf.Operation, queue: deque) -> None:
        for var_op in self._writes(op):
            if not self._allowed(op, var_op):
                self.refused.append((op, var_op))
            elif var_op.name not in self.per_rank_vars:  # its readers are per rank from now
                self.per_rank_vars.add(var_op.name)
                for reader in self.var_readers.get(var_op.name, ()):
                    self._reach(reader, op, queue)
                for out in var_op.outputs:  # a ref variable: its Identity reads
                    for consumer in out.consumers():
                        if consumer.type in ("Identity", "RefIdentity"):
                            self._reach(consumer, op, queue)
        for out in op.outputs:
            for consumer in out.consumers():
                if consumer.name in self.parent or consumer.type in _EQUALIZERS:
                    continue
                wanted = self._value_indices(consumer)
                if wanted is not None:
                    if not any(consumer.inputs[i] is out for i in wanted
                               if i < len(consumer.inputs)):
                        continue
                elif self._writes(consumer) and consumer.inputs[0] is out:
                    continue  # writing into a per-rank variable does not make a value per rank
                self._reach(consumer, op, queue)
        if op.type == "Identity" and op.inputs and op.inputs[0].op.type in ("Switch",
                                                                            "RefSwitch"):
            for consumer in op._control_outputs:  # the pivot of a cond branch or loop body
                self._reach(consumer, op, queue)

    def source_of(self, op: tf.Operation) -> tf.Operation:
        seen = 0
        while self.parent.get(op.name) is not None and seen < 100000:
            op, seen = self.parent[op.name], seen + 1
        return op


def _canned(var_names: list) -> tuple | None:
    for pattern, estimator, advice in _CANNED:
        if any(pattern.search(name) for name in var_names):
            return estimator, advice
    return None


def find_per_rank_updates(graph: tf.Graph) -> list:
    """(write op, variable op, source op) for every refused update of `graph` (see module doc)."""
    walk = _Walk(graph)
    walk.run()
    return [(op, var_op, walk.source_of(op)) for op, var_op in walk.refused]


def check_updates(graph: tf.Graph, rank: int, size: int) -> None:
    """Raises PerRankUpdateError when `graph` updates model state per rank (see module doc)."""
    refused = find_per_rank_updates(graph)
    if not refused:
        return
    lines = [f"  - op {op.name!r} ({op.type}) writes global variable {var_op.name!r} a value "
             f"computed from this rank's data (from {source.name!r}, {source.type}) without "
             "going through a collective"
             for op, var_op, source in refused[:10]]
    if len(refused) > 10:
        lines.append(f"  - and {len(refused) - 10} more")
    canned = _canned([var_op.name for _, var_op, _ in refused] + [op.name for op, _, _ in refused])
    head = (f"perseus_legacy (rank {rank} of {size}): this training graph updates model state "
            f"from each rank's own data, so every rank would train its own model instead of one "
            f"model on the global batch:\n" + "\n".join(lines) + "\n")
    if canned is not None:
        estimator, advice = canned
        head += f"These are the updates of {estimator}. {advice}.\n"
    head += ("To make an update synchronous, compute its value from perseus_legacy.allreduce(...) "
             "of this rank's contribution (e.g. op=perseus_legacy.Sum of the sums and counts), or "
             "train the variable with an optimizer (distribute_graph()/SyncReplicasHook average "
             "its gradient; or perseus_legacy.DistributedOptimizer). If each rank is meant to "
             "keep its own value, declare it with perseus_legacy.per_rank_update(variable_or_op) "
             "when building the graph.")
    raise PerRankUpdateError(head, [(op.name, var_op.name) for op, var_op, _ in refused])
