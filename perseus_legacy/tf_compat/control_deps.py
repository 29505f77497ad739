"""Patch: the collectives of one tf.function step may run concurrently.

Not tied to a TensorFlow version: every TensorFlow 2 chains the stateful ops of a tf.function in
program order (auto_control_deps), except those named in `ASYNC_STATEFUL_OPS`, where TensorFlow
lists its own collectives. The Perseus ops are stateful (so graph optimizers never fold or merge
them); chained, each collective would wait for the previous one, one round trip each, and
nothing would be fused. Adding them to the set lets them run as the data allows.
"""

from __future__ import annotations

# The op types of ops/tensorflow that a tf.function must not chain: every REGISTER_OP of
# kernels.cc (tests/test_tf_compat_registry.py compares them with the loaded library).
COLLECTIVE_OP_TYPES = ("PerseusAllreduce", "PerseusAllgather", "PerseusBroadcast",
                       "PerseusAlltoall", "PerseusGroupedAllreduce")

EXTENDED = "extended by perseus_legacy"
ABSENT = "absent in this TensorFlow: collectives in a tf.function run in program order"


def exempt_collectives_from_program_order() -> str:
    """Adds COLLECTIVE_OP_TYPES to auto_control_deps.ASYNC_STATEFUL_OPS; says what it did."""
    try:
        from tensorflow.python.framework import auto_control_deps
    except ImportError:
        return ABSENT
    exempt = getattr(auto_control_deps, "ASYNC_STATEFUL_OPS", None)
    if not isinstance(exempt, (set, frozenset)):
        return ABSENT
    auto_control_deps.ASYNC_STATEFUL_OPS = frozenset(exempt) | frozenset(COLLECTIVE_OP_TYPES)
    return EXTENDED
