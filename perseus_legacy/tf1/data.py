"""Input sharding for data-parallel training: every rank reads a disjoint part of the data."""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from perseus_legacy.common import basics

# Transformations whose output order (or content) depends on where they sit relative to shard().
_ORDER_CHANGING = {
    "ShuffleDataset": "shuffle",
    "ShuffleDatasetV2": "shuffle",
    "ShuffleDatasetV3": "shuffle",
    "ShuffleAndRepeatDataset": "shuffle_and_repeat",
    "ShuffleAndRepeatDatasetV2": "shuffle_and_repeat",
    "RepeatDataset": "repeat",
}


def _kind(node: Any) -> str | None:
    op = getattr(getattr(node, "_variant_tensor", None), "op", None)  # None eagerly
    try:
        op_type = op.type if op is not None else None
    except AttributeError:
        op_type = None
    if op_type in _ORDER_CHANGING:
        return _ORDER_CHANGING[op_type]
    return _ORDER_CHANGING.get(type(node).__name__.lstrip("_"))


def find_order_changing_transformation(dataset: tf.data.Dataset) -> str | None:
    """The name of a shuffle or repeat upstream of `dataset` (itself included), or None."""
    stack, seen = [dataset], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        kind = _kind(node)
        if kind is not None:
            return kind
        wrapped = getattr(node, "_dataset", None)  # tf.compat.v1 datasets wrap a v2 one
        if isinstance(wrapped, tf.data.Dataset):
            stack.append(wrapped)
        try:
            stack.extend(node._inputs())
        except (AttributeError, NotImplementedError):
            pass
    return None


def shard(dataset: tf.data.Dataset, index: int | None = None, count: int | None = None,
          allow_after_shuffle: bool = False) -> tf.data.Dataset:
    """Elements index, index + count, index + 2*count, ... of `dataset` (defaults: rank(), size()).

    Raises ValueError when a shuffle or repeat is upstream: shard first, then shuffle, then
    repeat. `allow_after_shuffle=True` skips the check (e.g. for a shuffle with a fixed seed,
    identical on every rank).
    """
    if index is None:
        basics.require_initialized("perseus_legacy.data.shard() without index")
        index = basics.rank()
    if count is None:
        basics.require_initialized("perseus_legacy.data.shard() without count")
        count = basics.size()
    if not 0 <= int(index) < int(count):
        raise ValueError(f"shard index {index} is not in [0, count={count})")
    if not allow_after_shuffle:
        kind = find_order_changing_transformation(dataset)
        if kind is not None:
            raise ValueError(
                f"perseus_legacy.data.shard(): the dataset already has a `{kind}` upstream. "
                "Sharding takes every count-th element of what reaches it; after a shuffle each "
                "rank has shuffled differently, and after a repeat epoch boundaries no longer "
                "line up with the shards, so ranks would see overlapping examples and some "
                "examples never. Shard first, then shuffle, then repeat: "
                "`dataset.shard(...)`/`data.shard(dataset)` -> `.shuffle(...)` -> `.repeat()`. "
                "If the order is identical on every rank (e.g. a shuffle with a fixed seed), pass "
                "allow_after_shuffle=True to skip this check.")
    return dataset.shard(int(count), int(index))


def sharded_input_fn(input_fn: Callable[..., Any], allow_after_shuffle: bool = False
                     ) -> Callable[..., Any]:
    """An input_fn returning `shard(input_fn(...))`: each rank trains on its own part.

    Use it for training input only. Never shard evaluation data: every rank should evaluate
    all of it, otherwise each rank's metrics are computed on a fraction of the data.
    """

    def wrapped(*args: Any, **kwargs: Any) -> tf.data.Dataset:
        dataset = input_fn(*args, **kwargs)
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                "sharded_input_fn needs an input_fn returning a tf.data.Dataset, got "
                f"{type(dataset).__name__}; shard the data inside input_fn instead")
        return shard(dataset, allow_after_shuffle=allow_after_shuffle)

    wrapped.__name__ = getattr(input_fn, "__name__", "input_fn")
    wrapped.__doc__ = getattr(input_fn, "__doc__", None)
    return wrapped
