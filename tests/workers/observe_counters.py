"""Fusion and the response cache, observed through perseus_legacy.runtime_stats().

`fusion`: 20 small allreduces submitted together; prints how many collectives ran for them.
`large`: 4 allreduces of 312.5 KiB each submitted together; prints how many collectives ran for
them (each alone on a fast network, fused where a collective's start-up costs more than copying).
`cache` (run with PERSEUS_CACHE_CAPACITY=3): a warm-up step, then repeated identical steps;
then two new names (evictions); then a cached name whose shape changes on the last rank after
warm-up (the coordinator's error).
`carried`: repeated small allreduces of every op, dtype and scaling, which travel with the cache
rounds (PERSEUS_CARRIED_ALLREDUCE_BYTES), and one above the budget, which does not.
Each phase prints `[rank r] <phase> {counter deltas}`; the
test compares them with its own expectations. Results are checked against numpy here.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from worker_util import assert_close, fail, rank_data

import perseus_legacy as hvd
from perseus_legacy import _core

AVERAGE, SUM, MIN, MAX, PRODUCT = range(5)
FUSION_TENSORS = 20
LARGE_TENSORS, LARGE_ELEMENTS = 4, 40_000  # float64: 320,000 bytes each
CACHED_NAMES = 3
CACHED_STEPS = 10
CARRIED_STEPS = 4
# name, dtype, shape, op, prescale, postscale: each under the default budget of 1024 bytes
CARRIED = [("c.sum", np.float64, (4,), SUM, 0.5, 3.0),
           ("c.avg", np.float32, (8,), AVERAGE, 1.0, 1.0),
           ("c.iavg", np.int64, (5,), AVERAGE, 1.0, 1.0),
           ("c.min", np.int32, (3,), MIN, 1.0, 1.0),
           ("c.max", np.float64, (2, 3), MAX, 1.0, 1.0),
           ("c.prod", np.int64, (4,), PRODUCT, 1.0, 1.0)]
BIG = ("c.big", np.float64, (160,), SUM, 1.0, 1.0)  # 1280 bytes: above the budget


def flat(stats: dict) -> dict:
    out = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


class Phase:
    """The counters' change over a `with` block, printed under `label`."""

    def __init__(self, rank: int, label: str):
        self.rank, self.label = rank, label

    def __enter__(self):
        self.before = flat(hvd.runtime_stats())
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            after = flat(hvd.runtime_stats())
            delta = {k: after[k] - self.before[k] for k in after}
            print(f"[rank {self.rank}] {self.label} {json.dumps(delta)}", flush=True)


def step(rank: int, size: int, names: list, seed: int, shape=(4,)) -> None:
    got = _core.grouped_allreduce([rank_data(rank, shape, np.float64, seed + i)
                                   for i in range(len(names))], names, op=SUM)
    for i, (name, out) in enumerate(zip(names, got)):
        expected = np.sum([rank_data(r, shape, np.float64, seed + i) for r in range(size)], 0)
        assert_close(rank, name, out, expected, rtol=1e-12)


def fusion(rank: int, size: int) -> None:
    with Phase(rank, "fusion"):
        step(rank, size, [f"fuse.{i}" for i in range(FUSION_TENSORS)], seed=1)


def large(rank: int, size: int) -> None:
    with Phase(rank, "large"):
        step(rank, size, [f"large.{i}" for i in range(LARGE_TENSORS)], seed=5,
             shape=(LARGE_ELEMENTS,))


def cache(rank: int, size: int) -> None:
    names = [f"cached.{i}" for i in range(CACHED_NAMES)]
    with Phase(rank, "warmup"):
        step(rank, size, names, seed=10)
    with Phase(rank, "repeated"):
        for s in range(CACHED_STEPS):
            step(rank, size, names, seed=20 + s)
    with Phase(rank, "new_names"):
        step(rank, size, ["new.0", "new.1"], seed=40)
    for s in range(2):
        step(rank, size, ["mm"], seed=50 + s, shape=(3,))
    with Phase(rank, "mismatch"):
        shape = (4,) if rank == size - 1 else (3,)
        try:
            _core.allreduce(np.ones(shape), "mm", op=SUM)
            fail(rank, "a shape that differs between ranks on a cached name raised no error")
        except RuntimeError as exc:
            if "shape mismatch" not in str(exc) or f"ranks [{size - 1}] [4]" not in str(exc):
                fail(rank, f"mismatch on a cached name: unexpected error {exc}")
    step(rank, size, ["after.mm"], seed=60)  # the runtime still works


def expected_allreduce(size: int, dtype, shape, op: int, pre: float, post: float,
                       seed: int) -> np.ndarray:
    inputs = [rank_data(r, shape, dtype, seed) for r in range(size)]
    if op == MIN:
        return np.min(inputs, 0)
    if op == MAX:
        return np.max(inputs, 0)
    if op == PRODUCT:
        return np.prod(inputs, 0).astype(dtype)
    if np.dtype(dtype).kind in "iu":  # an integer average divides exactly, after the sum
        total = np.sum(inputs, 0)
        return (total // size if op == AVERAGE else total).astype(dtype)
    total = np.sum([x.astype(np.float64) * pre for x in inputs], 0)
    return (total * post / (size if op == AVERAGE else 1)).astype(dtype)


def carried(rank: int, size: int) -> None:
    def one_step(seed: int) -> None:
        for i, (name, dtype, shape, op, pre, post) in enumerate(CARRIED + [BIG]):
            got = _core.allreduce(rank_data(rank, shape, dtype, seed + i), name, op=op,
                                  prescale_factor=pre, postscale_factor=post)
            assert_close(rank, name, got,
                         expected_allreduce(size, dtype, shape, op, pre, post, seed + i),
                         rtol=1e-6 if np.dtype(dtype) == np.float32 else 1e-12)

    one_step(seed=100)  # negotiated through the coordinator, then cached
    with Phase(rank, "carried"):
        for s in range(CARRIED_STEPS):
            one_step(seed=200 + 10 * s)


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    {"fusion": fusion, "large": large, "cache": cache, "carried": carried}[sys.argv[1]](rank, size)
    print(f"[rank {rank}] observe {sys.argv[1]} OK", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
