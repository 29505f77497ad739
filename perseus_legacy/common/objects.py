"""Python objects sent between ranks: broadcast_object, allgather_object, broadcast_object_fn.

Objects are pickled (with cloudpickle when it is installed, as Horovod does, else pickle) and
sent as bytes by the native collectives, so they work eagerly, in a TF1 graph program and
before any TensorFlow graph exists. Unpickling runs code chosen by the sender: use these only
between ranks of one job you trust.
"""

from __future__ import annotations

import collections
import itertools
import pickle
from typing import Any, Callable

import numpy as np

from perseus_legacy.common import basics
from perseus_legacy.common.process_sets import ProcessSet, process_set_id

try:
    import cloudpickle as _pickler
except ImportError:
    _pickler = pickle

# One counter per process set: ranks outside a set do not count its calls.
_counters: dict = collections.defaultdict(itertools.count)


def _name(kind: str, name: str | None, set_id: int = 0) -> str:
    # Ranks that make the same sequence of calls (in the set) agree on default names.
    if name:
        return f"PerseusObject/{name}"
    where = f"set{set_id}." if set_id else ""
    return f"PerseusObject/{where}{kind}.{next(_counters[set_id])}"


def _to_bytes(obj: Any) -> np.ndarray:
    return np.frombuffer(_pickler.dumps(obj), dtype=np.uint8)


def _from_bytes(data: np.ndarray) -> Any:
    return pickle.loads(np.ascontiguousarray(data, dtype=np.uint8).tobytes())


def _broadcast_bytes(obj: Any, root_rank: int, name: str, set_id: int = 0) -> Any:
    core = basics.core()
    rank = basics.rank()
    data = _to_bytes(obj) if rank == root_rank else np.zeros(0, np.uint8)
    length = core.broadcast(np.array([data.size], np.int64), root_rank, f"{name}.size",
                            process_set_id=set_id)
    if rank != root_rank:
        data = np.zeros(int(length[0]), np.uint8)
    received = core.broadcast(data, root_rank, f"{name}.data", process_set_id=set_id)
    return obj if rank == root_rank else _from_bytes(received)


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None,
                     name: str | None = None, process_set: ProcessSet | None = None) -> Any:
    """Returns `root_rank`'s `obj` on every rank (pickled: only between trusted ranks).

    Every rank (of `process_set`) must call it; the other ranks' `obj` is ignored.

    Args:
      obj: the value to send (used on `root_rank` only); picklable.
      root_rank: the global rank whose `obj` every rank gets.
      session: accepted for Horovod compatibility, not needed.
      name: names the collectives (default: counted per process set).
      process_set: among this ProcessSet's ranks only (default: every rank).

    Returns:
      `root_rank`'s `obj`.

    Raises:
      ValueError: `root_rank` is not a rank (of the set), or this rank is outside the set.
    """
    basics.require_initialized("broadcast_object()")
    set_id = process_set_id(process_set, "broadcast_object")
    return _broadcast_bytes(obj, basics.check_root(root_rank, "broadcast_object", set_id),
                            _name("broadcast", name, set_id), set_id)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet | None = None) -> Callable[[Any], Any]:
    """A function `f(obj)` returning `root_rank`'s `obj` on every rank (pickled, trusted ranks).

    Horovod builds placeholders and a Session for it; here it is broadcast_object with fixed
    arguments, usable in any mode.
    """
    basics.require_initialized("broadcast_object_fn()")
    set_id = process_set_id(process_set, "broadcast_object_fn")
    root_rank = basics.check_root(root_rank, "broadcast_object_fn", set_id)
    base = _name("broadcast_fn", name, set_id)
    calls = itertools.count()

    def broadcast(obj: Any) -> Any:
        return _broadcast_bytes(obj, root_rank, f"{base}.{next(calls)}", set_id)

    return broadcast


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: ProcessSet | None = None) -> list:
    """Every rank's `obj`, in rank order, on every rank (pickled: only between trusted ranks).

    With `process_set`, its ranks' objects, in the set's order.
    """
    basics.require_initialized("allgather_object()")
    set_id = process_set_id(process_set, "allgather_object")
    core = basics.core()
    name = _name("allgather", name, set_id)
    data = _to_bytes(obj)
    lengths = core.allgather(np.array([data.size], np.int64), f"{name}.sizes",
                             process_set_id=set_id)
    gathered = core.allgather(data, f"{name}.data", process_set_id=set_id)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return [_from_bytes(gathered[offsets[r]:offsets[r + 1]]) for r in range(len(lengths))]
