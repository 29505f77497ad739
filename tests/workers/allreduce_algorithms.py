"""Runs on every rank of one launch: the flat allreduce algorithms on every group size from 2 to
the launch's size, against numpy.

Group size n is the process set {0, ..., n - 1} (the global set for the launch's size). Each
member allreduces tensors of SIZES elements, one (dtype, op) of COMBOS each, rotating so that
every combination meets several group sizes, checks the result against numpy, and reads which
algorithm ran from runtime_stats()["allreduce_algorithms"]. Rank 0 prints one line per case:
"RAN n bytes algorithm". At the end every rank's results are compared bit for bit with every
other member's (through one allgather of their CRC-32s): the reduction order must be the same on
every rank. Any mismatch exits non-zero naming the rank. With PERSEUS_ALLREDUCE_ALGORITHM=torus,
also one tensor above 4 MiB over every rank (check_large_torus).
"""

from __future__ import annotations

import os
import zlib

import ml_dtypes
import numpy as np
from worker_util import (
    AVERAGE,
    MAX,
    MIN,
    PRODUCT,
    SUM,
    assert_close,
    expected_reduce,
    fail,
    rank_data,
    tolerance,
)

from perseus_legacy import _core
from perseus_legacy.common import basics, process_sets

# Elements: 1 and 3 (fewer than the ranks: empty halves and segments), then across the cut-overs
# of the cost model that the test sets (PERSEUS_ALLREDUCE_HOP_LATENCY_US).
SIZES = (1, 3, 100, 1000, 5000)
COMBOS = (("float32", SUM), ("float64", AVERAGE), ("int32", MIN), ("float16", SUM),
          (ml_dtypes.bfloat16, MAX), ("float64", PRODUCT), ("int64", SUM),
          ("uint8", MAX), ("int16", AVERAGE), ("float32", PRODUCT), ("int8", MIN),
          ("float16", AVERAGE), ("uint16", SUM))


def algorithms_ran() -> dict:
    return dict(_core.runtime_stats()["allreduce_algorithms"])


def check_large_torus(rank: int, size: int) -> None:
    """From 4 MiB the TCP transport overlaps the torus's rows and columns on slices: an odd count
    over every rank, against numpy and with the same bits on every rank."""
    count = (1 << 20) + 3
    data = [rank_data(r, (count,), "float32", seed=7) for r in range(size)]
    got = _core.allreduce(data[rank], "alg.torus.large", op=SUM)
    assert_close(rank, "torus, 4 MiB + 12 bytes", got, expected_reduce(data, SUM, "float32"),
                 **tolerance("float32"))
    everyone = _core.allgather(got[None, :], "alg.torus.large.bits")
    if not all(np.array_equal(row.view(np.uint32), got.view(np.uint32)) for row in everyone):
        fail(rank, "torus, 4 MiB + 12 bytes: ranks ended with different bits")


def main() -> None:
    basics.init()
    rank, size = _core.rank(), _core.size()
    digests = np.zeros((size + 1, len(SIZES)), dtype=np.int64)
    for n in range(2, size + 1):
        members = list(range(n))
        the_set = process_sets.add_process_set(members) if n < size else None
        set_id = the_set.process_set_id if the_set is not None else 0
        if rank in members:
            for i, count in enumerate(SIZES):
                dtype, op = COMBOS[(n + i) % len(COMBOS)]
                data = [rank_data(r, (count,), dtype, seed=16 * n + i) for r in members]
                before = algorithms_ran()
                got = _core.allreduce(data[rank], f"alg.{n}.{i}", op=op, process_set_id=set_id)
                after = algorithms_ran()
                ran = [name for name in after if after[name] != before[name]]
                expected = expected_reduce(data, op, dtype)
                assert_close(rank, f"{n} ranks, {count} x {np.dtype(dtype).name} op {op}", got,
                             expected, **tolerance(dtype))
                if len(ran) != 1:
                    fail(rank, f"{n} ranks, {count} elements: algorithm counters moved: {ran}")
                digests[n, i] = zlib.crc32(np.ascontiguousarray(got).tobytes())
                if rank == 0:
                    print(f"RAN {n} {count * np.dtype(dtype).itemsize} {ran[0]}", flush=True)
        if the_set is not None:
            process_sets.remove_process_set(the_set)
    if os.environ.get("PERSEUS_ALLREDUCE_ALGORITHM") == "torus":
        check_large_torus(rank, size)
    every = _core.allgather(digests.reshape(1, -1), "alg.digests").reshape(size, size + 1, -1)
    for n in range(2, size + 1):
        for i in range(len(SIZES)):
            values = {int(every[r, n, i]) for r in range(n)}
            if len(values) != 1:
                fail(rank, f"{n} ranks, {SIZES[i]} elements: ranks hold different bits "
                           f"(CRC-32 by rank: {[int(every[r, n, i]) for r in range(n)]})")
    _core.shutdown()
    print(f"[rank {rank}] allreduce algorithms OK", flush=True)


if __name__ == "__main__":
    main()
