"""Values that rank 0 passes to the other ranks (train_and_evaluate's metrics and exports).

JSON with a tag per value, never pickle: bytes received from a peer must not be able to run code.
Numpy scalars and arrays, bytes, tuples and dict keys of any of these types come back as they went.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np


def _tagged(value: Any) -> list:
    if value is None or isinstance(value, (bool, int, float, str)):
        return ["v", value]
    if isinstance(value, bytes):
        return ["b", base64.b64encode(value).decode("ascii")]
    if isinstance(value, (np.generic, np.ndarray)):
        return ["n", value.dtype.str, np.shape(value), np.asarray(value).tolist()]
    if isinstance(value, (list, tuple)):
        return ["l" if isinstance(value, list) else "t", [_tagged(v) for v in value]]
    if isinstance(value, dict):
        return ["d", [[_tagged(k), _tagged(v)] for k, v in value.items()]]
    raise TypeError(f"cannot pass a {type(value).__name__} from rank 0 to the other ranks "
                    "(None, numbers, str, bytes, numpy values, lists, tuples and dicts can be)")


def _untagged(item: list) -> Any:
    kind, rest = item[0], item[1:]
    if kind == "v":
        return rest[0]
    if kind == "b":
        return base64.b64decode(rest[0])
    if kind == "n":
        dtype, shape, data = rest
        array = np.asarray(data, dtype=np.dtype(dtype)).reshape(shape)
        return array if shape else array[()]
    if kind in ("l", "t"):
        values = [_untagged(v) for v in rest[0]]
        return values if kind == "l" else tuple(values)
    if kind == "d":
        return {_untagged(k): _untagged(v) for k, v in rest[0]}
    raise ValueError(f"unknown value tag {kind!r} in a payload from rank 0")


def encode(value: Any) -> bytes:
    """The JSON bytes of `value`; TypeError naming a type that JSON cannot carry."""
    return json.dumps(_tagged(value)).encode()


def decode(data: bytes) -> Any:
    """The value that encode() turned into `data`."""
    return _untagged(json.loads(data))
