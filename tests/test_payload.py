"""What rank 0 passes to the other ranks in train_and_evaluate goes as tagged JSON, never pickle."""

from __future__ import annotations

import numpy as np
import pytest

from perseus_legacy.estimator import _payload


def test_metrics_and_export_paths_come_back_with_their_numpy_types_and_bytes():
    value = ({"loss": np.float32(0.25), "global_step": np.int64(7), b"key": [1, 2.5, None, True]},
             [b"/tmp/export/1700000000", "text", np.arange(4, dtype=np.int16).reshape(2, 2)])
    back = _payload.decode(_payload.encode(value))
    metrics, exports = back
    assert type(metrics["loss"]) is np.float32 and metrics["loss"] == np.float32(0.25)
    assert type(metrics["global_step"]) is np.int64 and metrics["global_step"] == 7
    assert metrics[b"key"] == [1, 2.5, None, True]
    assert isinstance(back, tuple) and exports[:2] == [b"/tmp/export/1700000000", "text"]
    assert exports[2].dtype == np.int16 and exports[2].tolist() == [[0, 1], [2, 3]]


def test_a_value_json_cannot_carry_is_refused_by_name_and_nothing_is_unpickled():
    with pytest.raises(TypeError, match="cannot pass a set from rank 0"):
        _payload.encode({"metrics": {1, 2}})
    pickled = b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00K\x01."  # pickle.dumps(1)
    with pytest.raises(ValueError):
        _payload.decode(pickled)
