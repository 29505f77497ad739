"""The response cache (run with a small PERSEUS_CACHE_CAPACITY), checked against numpy.

Repeated steps over the same names in a different order on every rank and step (cache hits),
more names than the cache holds (eviction), a cached name submitted again with another shape,
dtype, op or collective (the entry is dropped everywhere), a mismatch between ranks on a cached
name (the coordinator's error), and a cached tensor that one rank submits much later than the
others (it moves to the coordinator).
"""

from __future__ import annotations

import random
import time

import numpy as np
from worker_util import assert_close, fail, rank_data

from perseus_legacy import _core

SUM, MAX = 1, 3


def expected_sum(size: int, shape, dtype, seed: int) -> np.ndarray:
    return np.sum([rank_data(r, shape, dtype, seed=seed) for r in range(size)], axis=0)


def steps(rank: int, size: int, names: list, count: int, shape, seed0: int) -> None:
    shuffle = random.Random(rank)
    for step in range(count):
        order = list(range(len(names)))
        shuffle.shuffle(order)
        seeds = [seed0 + 1000 * step + i for i in order]
        got = _core.grouped_allreduce([rank_data(rank, shape, np.float64, seed=s) for s in seeds],
                                      [names[i] for i in order], op=SUM)
        for g, s, i in zip(got, seeds, order):
            assert_close(rank, f"step {step} {names[i]}", g,
                         expected_sum(size, shape, np.float64, s), rtol=1e-12)


def changed_metadata(rank: int, size: int) -> None:
    for shape, dtype, op in (((4,), np.float32, SUM), ((2, 3), np.float32, SUM),
                             ((2, 3), np.int64, SUM), ((2, 3), np.int64, MAX),
                             ((2, 3), np.int64, MAX)):
        x = rank_data(rank, shape, dtype, seed=7)
        got = _core.allreduce(x, "changing", op=op)
        stacked = np.stack([rank_data(r, shape, dtype, seed=7) for r in range(size)])
        expected = stacked.sum(0) if op == SUM else stacked.max(0)
        assert_close(rank, f"'changing' as {np.dtype(dtype).name}{shape} op {op}", got,
                     expected.astype(dtype))
    got = _core.broadcast(rank_data(rank, (2, 3), np.int64, seed=8), 1 % size, "changing")
    assert_close(rank, "'changing' as a broadcast", got, rank_data(1 % size, (2, 3), np.int64, 8))
    got = _core.allgather(rank_data(rank, (rank + 1, 2), np.float32, seed=9), "changing")
    expected = np.concatenate([rank_data(r, (r + 1, 2), np.float32, seed=9) for r in range(size)])
    assert_close(rank, "'changing' as an allgather", got, expected)


def mismatch_on_a_cached_name(rank: int, size: int) -> None:
    for _ in range(2):
        _core.allreduce(np.ones(3), "mismatch", op=SUM)
    shape = (4,) if rank == size - 1 else (3,)
    try:
        _core.allreduce(np.ones(shape), "mismatch", op=SUM)
    except RuntimeError as exc:
        if "shape mismatch" not in str(exc) or f"ranks [{size - 1}] [4]" not in str(exc):
            fail(rank, f"mismatch on a cached name: unexpected error {exc}")
    else:
        if size > 1:
            fail(rank, "mismatch on a cached name: no error")


def late_rank_on_a_cached_name(rank: int, size: int) -> None:
    for step in range(3):
        if rank == size - 1 and step == 2:
            time.sleep(1.5)  # the others wait longer than the cache's limit (not a sync point)
        got = _core.allreduce(np.full(2, float(rank + step)), "late", op=SUM)
        assert_close(rank, f"'late' step {step}", got,
                     np.full(2, float(sum(range(size)) + size * step)))


def main() -> None:
    _core.init_mpi()
    rank, size = _core.rank(), _core.size()
    steps(rank, size, [f"few.{i}" for i in range(3)], 20, (5,), seed0=0)
    steps(rank, size, [f"many.{i}" for i in range(7)], 6, (2, 2), seed0=50_000)
    steps(rank, size, [f"few.{i}" for i in range(3)], 10, (5,), seed0=90_000)
    changed_metadata(rank, size)
    mismatch_on_a_cached_name(rank, size)
    late_rank_on_a_cached_name(rank, size)
    print(f"[rank {rank}] response cache OK", flush=True)
    _core.shutdown()


if __name__ == "__main__":
    main()
